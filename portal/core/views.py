"""Site-wide pages that are not any app's: the answer to a form posted without a valid CSRF token,
and `/favicon.ico`."""

from __future__ import annotations

from django.conf import settings
from django.http import HttpRequest, HttpResponse, HttpResponsePermanentRedirect
from django.shortcuts import render
from django.templatetags.static import static
from django.utils.http import url_has_allowed_host_and_scheme


def csrf_failure(request: HttpRequest, reason: str = "") -> HttpResponse:
    """CSRF_FAILURE_VIEW: a form sent after its session ended (logged out elsewhere, server restarted
    with a new key, a tab left open for days) is refused, as Django does, but with a page that says
    what happened and what to do, instead of "CSRF verification failed. Request aborted."."""
    referer = request.headers.get("Referer", "")
    back = (
        referer
        if referer
        and url_has_allowed_host_and_scheme(
            referer, allowed_hosts={request.get_host()}, require_https=request.is_secure()
        )
        else ""
    )
    context = {"back": back, "reason": reason, "debug": settings.DEBUG}
    return render(request, "csrf_failure.html", context, status=403)


def favicon(request: HttpRequest) -> HttpResponse:
    """Browsers ask for /favicon.ico on every page without a `<link rel="icon">` (the admin, JSON
    pages): send them to the committed icon instead of a 404 in the log each time."""
    response = HttpResponsePermanentRedirect(static("core/favicon.ico"))
    response["Cache-Control"] = "public, max-age=86400"
    return response
