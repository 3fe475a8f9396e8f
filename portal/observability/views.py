"""`/metrics`: the portal's Prometheus metrics, for a scraper holding PORTAL_METRICS_TOKEN."""

from __future__ import annotations

import hashlib
import hmac

from django.conf import settings
from django.http import Http404, HttpResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST

from .collector import exposition


def _token_matches(given: str, expected: str) -> bool:
    # Digests first, so the comparison takes the same time whatever the lengths.
    digest = hashlib.sha256
    return hmac.compare_digest(digest(given.encode()).digest(), digest(expected.encode()).digest())


@never_cache
@require_GET
def metrics(request):
    expected = settings.PORTAL_METRICS_TOKEN
    if not expected:
        raise Http404("Metrics are off (PORTAL_METRICS_TOKEN is not set).")
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not _token_matches(given.strip(), expected):
        response = HttpResponse("A valid metrics token is required.\n", status=401, content_type="text/plain")
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    return HttpResponse(exposition(), content_type=CONTENT_TYPE_LATEST)
