"""System checks of the portal's own settings."""

from __future__ import annotations

from urllib.parse import urlsplit

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


_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1", "0.0.0.0"})  # noqa: S104


@checks.register()
def benchmark_gateway_is_this_portal(app_configs, **kwargs) -> list[checks.CheckMessage]:
    """BENCHMARK_GATEWAY_URL set to this machine on a port the portal does not serve (PORTAL_PORT)
    sends every member's benchmark to another program or to nothing (issue 38). A warning, not an
    error: a relay on this machine may forward that port to the portal."""
    if settings.BENCHMARK_GATEWAY_URL_DERIVED:
        return []
    url = urlsplit(settings.BENCHMARK_GATEWAY_URL)
    try:
        port = url.port or (443 if url.scheme == "https" else 80)
    except ValueError:
        return []  # settings.py already refused a malformed URL
    if (url.hostname or "") not in _LOOPBACK or port == settings.PORTAL_PORT:
        return []
    return [
        checks.Warning(
            f"BENCHMARK_GATEWAY_URL={settings.BENCHMARK_GATEWAY_URL} is this machine on port {port}, "
            f"but the portal serves on PORTAL_PORT={settings.PORTAL_PORT}: members' benchmarks go "
            "through that URL and would reach another program or nothing.",
            hint="Unset BENCHMARK_GATEWAY_URL (it is then http://127.0.0.1:$PORTAL_PORT) or point it "
            "at this portal.",
            id="portal.W001",
        )
    ]
