"""`GET /v1/openapi.json`: the gateway's hand-written OpenAPI description (no key needed).

The gateway is plain async views, not DRF, so drf-spectacular does not see it;
tests/gateway/test_fuzz.py fuzzes the running gateway against this file.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt

from .errors import GatewayError, error_response

SCHEMA_PATH = Path(__file__).with_name("openapi.json")


@cache
def _schema_bytes() -> bytes:
    return SCHEMA_PATH.read_bytes()


@csrf_exempt
async def openapi(request: HttpRequest) -> HttpResponse:
    if request.method not in ("GET", "HEAD"):
        response = error_response(GatewayError(405, "Use GET.", code="method_not_allowed"))
        response["Allow"] = "GET"
        return response
    return HttpResponse(_schema_bytes(), content_type="application/json")
