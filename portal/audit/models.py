"""The audit log: who did what to which object, when and from where. Append-only.

Rows are written by `portal.audit.services.audit_event_record` and never changed
or deleted by the portal (the model and its queryset refuse; the admin is read-only),
except by the daily retention prune after `RETENTION_AUDIT_DAYS` (portal/dashboard/services.py).
"""

from __future__ import annotations

from django.conf import settings
from django.db import models


class AppendOnlyError(Exception):
    pass


class AuditEventQuerySet(models.QuerySet):
    def update(self, **kwargs):
        raise AppendOnlyError("audit events are never changed")

    def delete(self):
        raise AppendOnlyError("audit events are never deleted")


class AuditEvent(models.Model):
    at = models.DateTimeField(auto_now_add=True, db_index=True)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # Kept as text too, so the log still says who after the user is deleted.
    actor_repr = models.CharField(max_length=150, help_text="Username, or `system` (a command or task).")
    action = models.CharField(max_length=64, db_index=True, help_text="e.g. deployment.start, api_key.revoke")
    target_type = models.CharField(max_length=100, blank=True, help_text="app_label.model")
    target_id = models.CharField(max_length=64, blank=True)
    target_repr = models.CharField(max_length=200, blank=True)
    changes = models.JSONField(default=dict, blank=True, help_text="{field: [before, after]} or details.")
    ip = models.GenericIPAddressField(null=True, blank=True, help_text="The request's client address.")

    objects = AuditEventQuerySet.as_manager()

    class Meta:
        ordering = ["-at", "-id"]
        indexes = [models.Index(fields=["target_type", "target_id"], name="audit_target")]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor_repr} {self.action} {self.target_repr}"

    def save(self, *args, **kwargs) -> None:
        if not self._state.adding:
            raise AppendOnlyError("audit events are never changed")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise AppendOnlyError("audit events are never deleted")
