from django.apps import AppConfig


class DeploymentsConfig(AppConfig):
    name = "portal.deployments"
    label = "deployments"

    def ready(self) -> None:
        from . import signals  # noqa: F401  (drains sick GPUs when an inventory sample finds them)
