from django.apps import AppConfig


class BatchesConfig(AppConfig):
    name = "portal.batches"
    label = "batches"
