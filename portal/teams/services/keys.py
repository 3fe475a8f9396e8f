"""API keys: create, the member's hidden keys, new secrets, revoke; and how a key is checked.

An API key is `sk-<prefix>.<secret>`. Only the prefix (to find the row) and an
HMAC-SHA256 of the whole key (to check it, in constant time) are stored; the
key is returned once by `api_key_create` and never again.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import secrets
from functools import cache

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from portal.audit.services import audit_event_record
from portal.core.errors import ApplicationError

from ..models import BIGINT_MAX, INT_MAX, ApiKey, PriorityClass, Team
from .blocks import gateway_block

KEY_SCHEME = "sk-"


def api_key_hmac_secret() -> bytes:
    """GATEWAY_KEY_HMAC_SECRET, or a key derived from SECRET_KEY for this one purpose."""
    return _hmac_secret(settings.GATEWAY_KEY_HMAC_SECRET, settings.SECRET_KEY)


@cache
def _hmac_secret(explicit: str, secret_key: str) -> bytes:
    if explicit:
        return explicit.encode()
    return hmac.new(secret_key.encode(), b"portal.teams.api-key-digest", hashlib.sha256).digest()


def api_key_digest(token: str) -> str:
    return hmac.new(api_key_hmac_secret(), token.encode(), hashlib.sha256).hexdigest()


def api_key_prefix(token: str) -> str | None:
    """The prefix of a well-formed key, else None (nothing about the rest is revealed)."""
    if not token.startswith(KEY_SCHEME) or "." not in token or len(token) > 200:
        return None
    prefix = token[len(KEY_SCHEME) :].split(".", 1)[0]
    return prefix if 0 < len(prefix) <= 16 else None


def api_key_matches(token: str, digest: str) -> bool:
    return hmac.compare_digest(api_key_digest(token), digest)


def _clean_models(models: list[str] | None) -> list[str]:
    return sorted({m.strip() for m in (models or []) if m.strip()})


def api_key_create(
    *,
    team: Team,
    name: str = "",
    allowed_models: list[str] | None = None,
    expires_at: dt.datetime | None = None,
    created_by=None,
    rpm_limit: int | None = None,
    tpm_limit: int | None = None,
    tokens_per_day: int | None = None,
    max_concurrent: int | None = None,
    priority_class: str = "",
) -> tuple[ApiKey, str]:
    """Create a key; returns the row and the key itself, which is never shown again.

    `priority_class` blank: the team's. A member may make a key batch (it only gives capacity
    up), but only staff (or a shell command, `created_by` None) may make a batch team's key
    interactive: that would undo the class ops gave the team. A member's interactive key of an
    interactive team follows the team down if staff later make it batch
    (`ApiKey.effective_priority_class`); a class staff set holds."""
    if priority_class not in ("", *PriorityClass.values):
        raise ApplicationError(
            f"Must be one of {', '.join(PriorityClass.values)} (blank: the team's class).",
            field="priority_class",
        )
    if (
        priority_class == PriorityClass.INTERACTIVE
        and team.priority_class == PriorityClass.BATCH
        and created_by is not None
        and not created_by.is_staff
    ):
        raise ApplicationError(
            "The team is in the batch class; only staff may give one of its keys the interactive class.",
            field="priority_class",
        )
    for field, value, most in [
        ("rpm_limit", rpm_limit, INT_MAX),
        ("tpm_limit", tpm_limit, INT_MAX),
        ("tokens_per_day", tokens_per_day, BIGINT_MAX),
        ("max_concurrent", max_concurrent, INT_MAX),
    ]:
        if value is not None and value < 1:
            raise ApplicationError("Must be at least 1 (leave blank for no per-key limit).", field=field)
        if value is not None and value > most:
            raise ApplicationError(f"Must be at most {most}.", field=field)
    if expires_at is not None and expires_at <= timezone.now():
        raise ApplicationError("The expiry is in the past.", field="expires_at")
    models = _clean_models(allowed_models)
    if team.allowed_models:
        outside = sorted(set(models) - set(team.allowed_models))
        if outside:
            raise ApplicationError(f"The team may not use {', '.join(outside)}.", field="allowed_models")
    prefix = secrets.token_hex(6)
    token = f"{KEY_SCHEME}{prefix}.{secrets.token_urlsafe(32)}"
    key = ApiKey.objects.create(
        team=team,
        name=name,
        prefix=prefix,
        digest=api_key_digest(token),
        allowed_models=models,
        expires_at=expires_at,
        created_by=created_by,
        rpm_limit=rpm_limit,
        tpm_limit=tpm_limit,
        tokens_per_day=tokens_per_day,
        max_concurrent=max_concurrent,
        priority_class=priority_class,
        priority_class_set_by_staff=bool(priority_class) and (created_by is None or created_by.is_staff),
    )
    audit_event_record(
        action="api_key.create",
        target=key,
        actor=created_by,
        changes={"team": team.slug, "name": name, "allowed_models": models, "priority_class": priority_class},
    )
    return key, token


def member_key_for(*, team: Team, user, purpose: str) -> ApiKey:
    """The member's hidden key of `team` for `purpose` ("playground" or "benchmark"), with its team
    loaded, made on first use: one key per (team, member, purpose), named "<purpose> (<user>)" so
    usage says whose it is. Its first secret is dropped at once (nothing holds it).

    Claimed by a conditional UPDATE: a second first use racing this one hits the unique constraint
    on `<purpose>_user` and takes the winner's key instead."""
    owner_field = {"playground": "playground_user", "benchmark": "benchmark_user"}[purpose]
    keys = ApiKey.objects.select_related("team").filter(team=team)
    found = keys.filter(**{owner_field: user}).first()
    if found is not None:
        return found
    try:
        with transaction.atomic():
            name = f"{purpose} ({user.get_username()})"[:100]
            key, _discarded = api_key_create(team=team, name=name, created_by=user)
            ApiKey.objects.filter(pk=key.pk, **{f"{owner_field}__isnull": True}).update(**{owner_field: user})
    except IntegrityError:
        pass
    return keys.get(**{owner_field: user})


def api_key_new_secret(
    *, api_key: ApiKey, allowed_models: list[str] | None = None, pinned_deployment_id: int | None = None
) -> str:
    """A new prefix and secret for a key the portal itself holds (a member's benchmark key), its
    models and pinned deployment set with them; returns the key, which exists nowhere else.

    The old secret stops working in every web process within GATEWAY_CACHE_S: the gateway caches
    key rows by prefix, and the old prefix no longer finds a row. A revoked key stays revoked."""
    prefix = secrets.token_hex(6)
    token = f"{KEY_SCHEME}{prefix}.{secrets.token_urlsafe(32)}"
    ApiKey.objects.filter(pk=api_key.pk).update(
        prefix=prefix,
        digest=api_key_digest(token),
        allowed_models=_clean_models(allowed_models),
        pinned_deployment_id=pinned_deployment_id,
    )
    api_key.refresh_from_db()
    return token


def api_key_revoke(*, api_key: ApiKey) -> bool:
    """Revoke a key for good. Takes effect on the next request in every web process: the
    gateway checks Redis's block list inside its admission script. False if already revoked."""
    updated = ApiKey.objects.filter(pk=api_key.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())
    if updated:
        transaction.on_commit(lambda: gateway_block("key", api_key.pk, reason="revoked"))
        audit_event_record(action="api_key.revoke", target=api_key, changes={"team": api_key.team.slug})
    return bool(updated)
