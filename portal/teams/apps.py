from django.apps import AppConfig


class TeamsConfig(AppConfig):
    name = "portal.teams"
    label = "teams"

    def ready(self) -> None:
        from . import signals  # noqa: F401  (audits team quota changes from every path)
