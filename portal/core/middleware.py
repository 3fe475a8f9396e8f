"""Refuse text that no column can hold, before any view looks it up.

PostgreSQL text cannot contain NUL (U+0000), and a lone surrogate (`"\\ud800"` in
JSON) cannot be encoded as UTF-8: either one in a lookup or a save is a database
error, i.e. a 500, wherever a name from the URL, the query string or the body
reaches a query (found by fuzzing the API). Nothing the portal stores may contain
them, so a request carrying one anywhere gets a 400 that says why.
"""

from __future__ import annotations

from django.http import HttpResponse, JsonResponse

from .jsonbody import TOO_DEEP, JsonTooDeep, loads

MESSAGE = "The request contains a NUL character or a lone surrogate, which no field accepts."
FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")


def bad_text(value: object, *, allow_nul: bool = False) -> bool:
    """True if any string in `value` (a string, or JSON-like nesting of them) cannot be stored:
    a lone surrogate (not UTF-8) or, unless `allow_nul` (text that is sent on, never stored), a NUL."""
    if isinstance(value, str):
        if not allow_nul and "\x00" in value:
            return True
        try:
            value.encode()
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(bad_text(text, allow_nul=allow_nul) for pair in value.items() for text in pair)
    if isinstance(value, list):
        return any(bad_text(v, allow_nul=allow_nul) for v in value)
    return False


def _query_is_bad(querydict) -> bool:
    return any(bad_text(key) or bad_text(values) for key, values in querydict.lists())


def _body_is_bad(request) -> bool:
    content_type = request.content_type or ""
    if content_type.startswith(FORM_TYPES):
        return _query_is_bad(request.POST)
    if content_type == "application/json" or content_type.endswith("+json"):
        body = request.body
        if b"\\u" not in body:  # NUL and lone surrogates reach JSON text only as \u escapes
            return False
        try:
            parsed = loads(body)
        except JsonTooDeep:
            raise
        except ValueError:
            return False  # not JSON at all: the view's parser answers that
        try:
            return bad_text(parsed)
        except RecursionError:  # parsed, but too deep to walk
            raise JsonTooDeep from None
    return False


def _refusal(request, message: str):
    if request.path_info.startswith("/api/"):
        return JsonResponse({"detail": message}, status=400)
    return HttpResponse(message, status=400, content_type="text/plain; charset=utf-8")


class RejectUnstorableTextMiddleware:
    def __init__(self, get_response) -> None:
        self.get_response = get_response

    def __call__(self, request):
        try:
            bad = bad_text(request.path_info) or _query_is_bad(request.GET) or _body_is_bad(request)
        except JsonTooDeep:
            return _refusal(request, TOO_DEEP)
        if bad:
            return _refusal(request, MESSAGE)
        return self.get_response(request)
