from django.apps import AppConfig


class CoreConfig(AppConfig):
    name = "portal.core"
    label = "core"

    def ready(self) -> None:
        from . import signals  # noqa: F401  (connects the receivers)
