"""`--middleware inference.vllm_guard.guard`: vLLM's API key on every path, not only its prefixes.

vLLM (0.32) checks `VLLM_API_KEY` only on paths under /v1, /v2, /inference and /cohere.
Everything else stays open, and some of it serves the model: POST /invocations (the
SageMaker route, always mounted) runs completions and chat without any key, and
/tokenize, /detokenize, /pooling, /score … answer too. The node agent therefore
launches vLLM with this middleware, which refuses every path but the open ones below
without `Authorization: Bearer <VLLM_API_KEY>`.

It runs inside the node's vLLM environment (the agent puts the portal's code on
PYTHONPATH), so it imports nothing but the standard library.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Awaitable, Callable
from typing import Any

# What supervision and Prometheus read without a key: liveness, counters, the version.
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})

_KEY = os.environ.get("VLLM_API_KEY", "")
_KEY_HASH = hashlib.sha256(_KEY.encode()).digest() if _KEY else b""


def allowed(path: str, method: str, authorization: str | None) -> bool:
    """Whether a request may pass: an open path, a preflight, no key configured, or the key."""
    if not _KEY_HASH or method == "OPTIONS" or path.rstrip("/") in OPEN_PATHS:
        return True
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(hashlib.sha256(token.encode()).digest(), _KEY_HASH)


# Starlette's Request and Response: vLLM's dependency, not the portal's, so typed loosely here.
async def guard(request: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
    """An `@app.middleware("http")` function (vLLM adds a coroutine function that way)."""
    if allowed(request.url.path, request.method, request.headers.get("authorization")):
        return await call_next(request)
    from starlette.responses import Response  # vLLM's own dependency, present where this runs

    return Response(json.dumps({"error": "Unauthorized"}), status_code=401, media_type="application/json")
