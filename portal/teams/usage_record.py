"""The usage record: what the gateway queues in Redis for each request, and the flush reads back.

One request that got past authentication gives one record. The gateway builds it at the end
of the request (`portal/gateway/usage.py`); its admission script pushes `to_dict()` as JSON
onto the usage list; `portal/teams/services/usage_queue.py` reads each entry with `from_json`
and stores it as a `Usage` row. Both ends use this class, so the JSON keys are written in one
place.

The wire format is a JSON object with the field names below; `created_at` is seconds since
the epoch and `request_id` 32 hex digits. Reading is as lenient as the records already in a
queue need: `priority_class` and `error_code` may be absent (queued by a gateway from before
them), an id that is not an integer reads as none (the flush refuses the record or unlinks
it). Numbers are taken as written: a value the database cannot hold (a token count over
2^31, a status code that is no number) is the database's to refuse, and the flush
dead-letters that record as refused rather than unreadable.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from dataclasses import dataclass
from typing import Any

from .models import PriorityClass, UsageStatus


class UnreadableUsageRecord(ValueError):
    """An entry of the usage list that is no usage record (not JSON, a field missing or malformed)."""


@dataclass(frozen=True)
class UsageRecord:
    request_id: uuid.UUID
    created_at: dt.datetime  # when the request arrived, by the gateway host's clock (UTC)
    team_id: int
    api_key_id: int | None
    model: str
    deployment_id: int | None  # the replica it was placed on, or the last one it was sent to
    endpoint: str
    priority_class: PriorityClass
    stream: bool
    status: UsageStatus
    http_status: int
    error_code: str
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float | None
    duration_ms: float

    def to_dict(self) -> dict[str, Any]:
        """The record as the usage list holds it (plain JSON types)."""
        return {
            "request_id": self.request_id.hex,
            "created_at": self.created_at.timestamp(),
            "team_id": self.team_id,
            "api_key_id": self.api_key_id,
            "model": self.model,
            "deployment_id": self.deployment_id,
            "endpoint": self.endpoint,
            "priority_class": str(self.priority_class),
            "stream": self.stream,
            "status": str(self.status),
            "http_status": self.http_status,
            "error_code": self.error_code,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "ttft_ms": self.ttft_ms,
            "duration_ms": self.duration_ms,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, raw: bytes | str) -> UsageRecord:
        """Read one entry of the usage list; `UnreadableUsageRecord` if it is none."""
        try:
            data = json.loads(raw)
            return cls(
                request_id=uuid.UUID(data["request_id"]),
                created_at=dt.datetime.fromtimestamp(data["created_at"], tz=dt.UTC),
                team_id=int(data["team_id"]),
                api_key_id=_id_or_none(data.get("api_key_id")),
                model=str(data.get("model") or ""),
                deployment_id=_id_or_none(data.get("deployment_id")),
                endpoint=str(data.get("endpoint") or ""),
                # Records queued before the gateway knew classes carry none: they were interactive.
                priority_class=PriorityClass(data.get("priority_class"))
                if data.get("priority_class") in PriorityClass.values
                else PriorityClass.INTERACTIVE,
                stream=bool(data.get("stream")),
                status=UsageStatus(data["status"]),
                http_status=data["http_status"],
                error_code=str(data.get("error_code") or ""),
                prompt_tokens=max(0, int(data.get("prompt_tokens") or 0)),
                completion_tokens=max(0, int(data.get("completion_tokens") or 0)),
                ttft_ms=data.get("ttft_ms"),
                duration_ms=data.get("duration_ms") or 0.0,
            )
        # AttributeError: a request id that is no string (an int has no `.replace`).
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError, OSError) as error:
            raise UnreadableUsageRecord(str(error)) from None


def _id_or_none(value: object) -> int | None:
    return value if isinstance(value, int) else None
