from django.apps import AppConfig


class DeploymentsConfig(AppConfig):
    name = "portal.deployments"
    label = "deployments"

    def ready(self) -> None:
        # The usage flush (teams, a layer below) links records only to deployments that exist.
        from portal.teams.services.usage_queue import usage_deployment_check_set

        from . import signals  # noqa: F401  (drains sick GPUs when an inventory sample finds them)
        from .selectors import deployment_ids_existing

        usage_deployment_check_set(deployment_ids_existing)
