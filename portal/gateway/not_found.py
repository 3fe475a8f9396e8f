"""An unknown path under `/v1/` answers like the rest of the gateway: OpenAI's error JSON (404),
naming the closest endpoint it serves, so a typo in a client's base URL or path reads as one."""

from __future__ import annotations

import difflib

from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt

from .errors import GatewayError, error_response

# With the batch API beside it (portal/batches, routed before this catch-all).
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/files", "/v1/batches")


def closest_endpoint(path: str) -> str | None:
    """The served endpoint `path` most likely meant (`/v1/chat/completion` → `/v1/chat/completions`)."""
    # Bounded: a path is at most what the server accepts, and difflib is quadratic in length.
    match = difflib.get_close_matches(path.rstrip("/")[:200], ENDPOINTS, n=1, cutoff=0.6)
    return match[0] if match else None


@csrf_exempt
async def unknown_path(request: HttpRequest, rest: str = "") -> HttpResponse:
    path = request.path
    message = f"Unknown endpoint {request.method} {path[:200]}."
    suggestion = closest_endpoint(path)
    if suggestion:
        message += f" Did you mean {suggestion}?"
    message += f" The gateway serves {', '.join(ENDPOINTS)}."
    return error_response(GatewayError(404, message, code="unknown_url"))
