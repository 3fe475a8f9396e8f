"""A source the services do not see: the Django admin's own log.

Every add/change/delete in the admin writes a LogEntry; each is mirrored as an
`admin.<add|change|delete>` event. (Apps above audit record their own changes with
`audit_event_record`; teams records quota edits from every path in teams/signals.py.)
"""

from __future__ import annotations

from typing import cast

from django.contrib.admin.models import ADDITION, CHANGE, DELETION, LogEntry
from django.contrib.contenttypes.models import ContentType
from django.db.models.signals import post_save
from django.dispatch import receiver

from .services import audit_event_record

ADMIN_ACTIONS = {ADDITION: "admin.add", CHANGE: "admin.change", DELETION: "admin.delete"}


@receiver(post_save, sender=LogEntry, dispatch_uid="audit-admin-log-entry")
def mirror_admin_log_entry(sender, instance: LogEntry, created: bool, **kwargs) -> None:
    if not created:
        return
    # django-stubs leaves LogEntry.content_type an unbound type variable.
    content_type = cast("ContentType | None", instance.content_type)
    audit_event_record(
        action=ADMIN_ACTIONS.get(instance.action_flag, "admin.other"),
        actor=instance.user,
        target_type=f"{content_type.app_label}.{content_type.model}" if content_type else "",
        target_id=instance.object_id or "",
        target_repr=instance.object_repr,
        changes={"message": instance.get_change_message()} if instance.change_message else {},
    )
