"""Two sources the services do not see: the Django admin's own log, and team quota edits.

Every add/change/delete in the admin writes a LogEntry; each is mirrored as an
`admin.<add|change|delete>` event. A change of a team's quotas (from the admin,
the API or a shell) is recorded with the values before and after, whichever path
saved it.
"""

from __future__ import annotations

from django.contrib.admin.models import ADDITION, CHANGE, DELETION, LogEntry
from django.db.models.signals import post_save, pre_save
from django.dispatch import receiver

from portal.teams.models import Team

from .services import audit_event_record, changed_fields, field_values

ADMIN_ACTIONS = {ADDITION: "admin.add", CHANGE: "admin.change", DELETION: "admin.delete"}
TEAM_QUOTA_FIELDS = ["gpu_quota", "rpm_limit", "tpm_limit", "tokens_per_day", "max_concurrent",
                     "max_tokens_clamp", "allowed_models"]  # fmt: skip


@receiver(post_save, sender=LogEntry, dispatch_uid="audit-admin-log-entry")
def mirror_admin_log_entry(sender, instance: LogEntry, created: bool, **kwargs) -> None:
    if not created:
        return
    content_type = instance.content_type
    audit_event_record(
        action=ADMIN_ACTIONS.get(instance.action_flag, "admin.other"),
        actor=instance.user,
        target_type=f"{content_type.app_label}.{content_type.model}" if content_type else "",
        target_id=instance.object_id or "",
        target_repr=instance.object_repr,
        changes={"message": instance.get_change_message()} if instance.change_message else {},
    )


@receiver(pre_save, sender=Team, dispatch_uid="audit-team-quota-before")
def remember_team_quotas(sender, instance: Team, **kwargs) -> None:
    if instance.pk is None:
        instance._audit_quotas_before = None
        return
    before = Team.objects.filter(pk=instance.pk).first()
    instance._audit_quotas_before = field_values(before, TEAM_QUOTA_FIELDS) if before else None


@receiver(post_save, sender=Team, dispatch_uid="audit-team-quota-after")
def record_team_quota_change(sender, instance: Team, created: bool, **kwargs) -> None:
    before = getattr(instance, "_audit_quotas_before", None)
    if created or before is None:
        return
    changes = changed_fields(before, field_values(instance, TEAM_QUOTA_FIELDS))
    if changes:
        audit_event_record(action="team.quotas_change", target=instance, changes=changes)
