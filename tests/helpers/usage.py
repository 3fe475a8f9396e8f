"""Usage records as the gateway queues them in Redis, for the flusher's tests."""

from __future__ import annotations

import json
import uuid

from django.utils import timezone

from portal.core.redis.client import redis_keys


def record(
    team, key=None, *, status="completed", prompt=10, completion=20, when=None, request_id=None
) -> dict:
    return {
        "request_id": request_id or uuid.uuid4().hex,
        "created_at": (when or timezone.now()).timestamp(),
        "team_id": team.pk,
        "api_key_id": key.pk if key else None,
        "model": "m1",
        "deployment_id": None,
        "endpoint": "chat",
        "stream": True,
        "status": status,
        "http_status": 200 if status == "completed" else 429,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "ttft_ms": 12.5,
        "duration_ms": 80.0,
    }


def push(client, *records) -> None:
    client.rpush(redis_keys().usage, *[json.dumps(r) for r in records])


def dead_letters(client) -> list[tuple[str, dict | str]]:
    """(reason, the record as queued) of each dead-lettered record, oldest first."""
    out = []
    for raw in client.lrange(redis_keys().usage_dead, 0, -1):
        entry = json.loads(raw)
        try:
            record = json.loads(entry["record"])
        except ValueError:
            record = entry["record"]
        out.append((entry["reason"], record))
    return out


def usage_row(team, *, status: str, http_status: int, prompt_tokens: int, completion_tokens: int):
    """One usage record of `team`, stored now (as the flush would), for the pages' tests."""
    from portal.teams.models import Usage

    return Usage.objects.create(
        request_id=uuid.uuid4(),
        created_at=timezone.now(),
        team=team,
        model="m",
        status=status,
        http_status=http_status,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        duration_ms=9,
    )
