"""Team quota edits are audited whichever path saved them (the admin, the API, a shell).

A signal rather than the services, because the admin and a shell save teams without them;
the change is recorded with the values before and after.
"""

from __future__ import annotations

from django.db.models.signals import post_save, pre_save
from django.dispatch import receiver

from portal.audit.services import audit_event_record, changed_fields, field_values

from .models import Team

TEAM_QUOTA_FIELDS = ["gpu_quota", "rpm_limit", "tpm_limit", "tokens_per_day", "max_concurrent",
                     "max_tokens_clamp", "allowed_models", "priority_class"]  # fmt: skip


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
