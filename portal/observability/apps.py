from django.apps import AppConfig


class ObservabilityConfig(AppConfig):
    name = "portal.observability"
    label = "observability"

    def ready(self) -> None:
        # Celery task outcomes are counted wherever a task runs (control worker, node agents).
        from . import signals  # noqa: F401
