"""System checks of the portal's own settings."""

from __future__ import annotations

from django.conf import settings
from django.core import checks


@checks.register(checks.Tags.security, deploy=True)
def redis_namespace_is_explicit(app_configs, **kwargs) -> list[checks.CheckMessage]:
    """In production every process must name the namespace: derived from the database URL, a web
    process and a worker that spell it differently would split usage and queues without a word."""
    if not settings.PORTAL_REDIS_NAMESPACE_DERIVED:
        return []
    return [
        checks.Error(
            "PORTAL_REDIS_NAMESPACE is not set: it is derived from how DATABASE_URL is spelled "
            f"({settings.PORTAL_REDIS_NAMESPACE}), so processes configured a little differently "
            "would use different Redis keys.",
            hint="Set PORTAL_REDIS_NAMESPACE to the same value in every web and worker process.",
            id="portal.E001",
        )
    ]
