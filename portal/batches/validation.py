"""Validation before anything runs: every line of the input file parsed and checked, with the
gateway's own parsing (`portal.gateway.parsing.parse`, the same rules as an HTTP request of the
key: fields, models the key may call, `n`, `max_tokens` clamped by the team's clamp). Any bad line
fails the batch, each reported in `errors` as OpenAI does ({"code", "message", "param", "line"})."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from django.conf import settings

from portal.gateway.errors import GatewayError
from portal.gateway.internal import Caller
from portal.gateway.parsing import parse

from .models import BatchEndpoint

# The most per-line errors kept on a failed batch (a 50,000-line file of bad lines says enough).
MAX_ERRORS = 1000
CUSTOM_ID_MAX = 512


@dataclass
class Checked:
    lines: list[tuple[int, str, dict]] = field(default_factory=list)  # (line number, custom_id, body)
    errors: list[dict] = field(default_factory=list)

    def refuse(self, code: str, message: str, *, line: int | None = None, param: str | None = None) -> None:
        if len(self.errors) < MAX_ERRORS:
            self.errors.append({"code": code, "message": message, "param": param, "line": line})


def validate_file(content: bytes, *, endpoint: str, caller: Caller) -> Checked:
    """The lines of `content` (JSONL) if every one is valid for `endpoint` and `caller`, and the
    errors otherwise; blank lines are skipped, numbers count every line from 1."""
    checked = Checked()
    if len(content) > settings.BATCH_FILE_MAX_BYTES:
        checked.refuse("file_too_large", f"The file is over {settings.BATCH_FILE_MAX_BYTES} bytes.")
        return checked
    raw_lines = content.split(b"\n")
    numbered = [(n, raw) for n, raw in enumerate(raw_lines, start=1) if raw.strip()]
    if not numbered:
        checked.refuse("empty_file", "The input file has no requests.")
        return checked
    if len(numbered) > settings.BATCH_MAX_LINES:
        checked.refuse(
            "too_many_requests",
            f"The file has {len(numbered)} requests; at most {settings.BATCH_MAX_LINES} (BATCH_MAX_LINES).",
        )
        return checked
    seen: set[str] = set()
    for number, raw in numbered:
        _check_line(checked, number, raw, endpoint=endpoint, caller=caller, seen=seen)
    if checked.errors:
        checked.lines = []
    return checked


def _check_line(
    checked: Checked, number: int, raw: bytes, *, endpoint: str, caller: Caller, seen: set[str]
) -> None:
    def refuse(code: str, message: str, param: str | None = None) -> None:
        checked.refuse(code, message, line=number, param=param)

    if len(raw) > settings.BATCH_LINE_MAX_BYTES:
        return refuse("line_too_large", f"The line is over {settings.BATCH_LINE_MAX_BYTES} bytes.")
    try:
        line = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return refuse("invalid_json_line", "The line is not valid JSON.")
    if not isinstance(line, dict):
        return refuse("invalid_json_line", "The line must be a JSON object.")
    custom_id = line.get("custom_id")
    if (
        not isinstance(custom_id, str)
        or not custom_id
        or len(custom_id) > CUSTOM_ID_MAX
        or "\x00" in custom_id
    ):
        return refuse(
            "invalid_custom_id",
            f"`custom_id` must be a string of 1 to {CUSTOM_ID_MAX} characters.",
            "custom_id",
        )
    if custom_id in seen:
        return refuse("duplicate_custom_id", f"The custom_id `{custom_id[:80]}` is used twice.", "custom_id")
    seen.add(custom_id)
    if line.get("method") != "POST":
        return refuse("invalid_method", "`method` must be `POST`.", "method")
    if line.get("url") != endpoint:
        return refuse("invalid_url", f"`url` must be the batch's endpoint, `{endpoint}`.", "url")
    body = line.get("body")
    if not isinstance(body, dict):
        return refuse("invalid_body", "`body` must be a JSON object.", "body")
    if body.get("stream"):
        return refuse("invalid_body", "A batch request cannot stream: leave `stream` out.", "body.stream")
    encoded = json.dumps(body, separators=(",", ":")).encode()
    if len(encoded) > settings.GATEWAY_MAX_BODY_BYTES:
        return refuse("invalid_body", f"`body` is over {settings.GATEWAY_MAX_BODY_BYTES} bytes.", "body")
    try:  # the gateway's own rules: what it would refuse is refused here, before anything runs
        parse(encoded, chat=endpoint == BatchEndpoint.CHAT, caller=caller)
    except GatewayError as error:
        return refuse(error.code, error.message, f"body.{error.param}" if error.param else "body")
    checked.lines.append((number, custom_id, body))
    return None
