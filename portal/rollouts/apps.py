from django.apps import AppConfig


class RolloutsConfig(AppConfig):
    name = "portal.rollouts"
    label = "rollouts"
