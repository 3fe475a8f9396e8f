"""The gateway's settings, read once per process into one record rather than on every request.

Every read of `django.conf.settings` goes through its lazy object's Python-level attribute
hook; a streamed request read about ten of them. The record is rebuilt when a setting
changes in a test (Django's `setting_changed` signal), so `override_settings` still works.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver


@dataclass(frozen=True)
class GatewaySettings:
    max_body_bytes: int
    cache_s: float
    cache_grace_s: float
    long_prompt_tokens: int
    first_token_timeout_s: float
    first_token_timeout_long_s: float
    queue_timeout_s: float
    batch_queue_timeout_s: float
    batch_share: float
    # The per-deployment limits every placement applies (RateLimiter keyword arguments), by class.
    interactive_queue: dict = field(repr=False)
    batch_queue: dict = field(repr=False)


def _read() -> GatewaySettings:
    common = {
        "long_cap": settings.GATEWAY_LONG_PROMPT_MAX_INFLIGHT,
        "queue_max": settings.GATEWAY_QUEUE_MAX,
        "interactive_timeout_s": settings.GATEWAY_QUEUE_TIMEOUT_S,
    }
    return GatewaySettings(
        max_body_bytes=settings.GATEWAY_MAX_BODY_BYTES,
        cache_s=settings.GATEWAY_CACHE_S,
        cache_grace_s=settings.GATEWAY_CACHE_GRACE_S,
        long_prompt_tokens=settings.GATEWAY_LONG_PROMPT_TOKENS,
        first_token_timeout_s=settings.GATEWAY_FIRST_TOKEN_TIMEOUT_S,
        first_token_timeout_long_s=settings.GATEWAY_FIRST_TOKEN_TIMEOUT_LONG_S,
        queue_timeout_s=settings.GATEWAY_QUEUE_TIMEOUT_S,
        batch_queue_timeout_s=settings.GATEWAY_BATCH_QUEUE_TIMEOUT_S,
        batch_share=settings.GATEWAY_BATCH_SHARE,
        interactive_queue={**common, "timeout_s": settings.GATEWAY_QUEUE_TIMEOUT_S, "batch_share": None},
        batch_queue={
            **common,
            "timeout_s": settings.GATEWAY_BATCH_QUEUE_TIMEOUT_S,
            "batch_share": settings.GATEWAY_BATCH_SHARE,
        },
    )


_current: GatewaySettings | None = None


def gateway_settings() -> GatewaySettings:
    global _current
    if _current is None:
        _current = _read()
    return _current


@receiver(setting_changed)
def _forget(**_kwargs) -> None:
    global _current
    _current = None
