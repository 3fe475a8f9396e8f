from django.apps import AppConfig


class RegistryConfig(AppConfig):
    name = "portal.registry"
    label = "registry"
