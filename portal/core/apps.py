from django.apps import AppConfig


class CoreConfig(AppConfig):
    name = "portal.core"
    label = "core"

    def ready(self) -> None:
        from . import checks, signals  # noqa: F401  (registers the checks, connects the receivers)
