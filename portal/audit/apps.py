from django.apps import AppConfig


class AuditConfig(AppConfig):
    name = "portal.audit"
    label = "audit"
    verbose_name = "audit log"

    def ready(self) -> None:
        from . import signals  # noqa: F401  (mirrors the admin's LogEntry)
