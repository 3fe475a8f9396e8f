"""The gateway's request record reads headers as Django's ASGIRequest does (the views, the client
address and the auth throttle read META), and applies Django's ALLOWED_HOSTS rule."""

from __future__ import annotations

import io

import pytest
from django.core.exceptions import DisallowedHost
from django.core.handlers.asgi import ASGIRequest

from portal.gateway.asgi import GatewayRequest

HEADER_SETS = [
    [(b"host", b"gw.example"), (b"authorization", b"Bearer sk-a.b"), (b"content-type", b"application/json")],
    # A repeated header is joined with commas, in order.
    [(b"host", b"gw.example"), (b"x-forwarded-for", b"10.0.0.1"), (b"x-forwarded-for", b"10.0.0.2")],
    # An underscore in a name is dropped: it must not pose as X-Forwarded-For or Authorization.
    [(b"host", b"gw.example"), (b"x_forwarded_for", b"6.6.6.6"), (b"x-forwarded-for", b"10.0.0.3")],
    [(b"host", b"gw.example"), (b"authorization", b"Bearer sk-a.b"), (b"authorization", b"Bearer sk-c.d")],
    [(b"host", b"gw.example"), (b"content-length", b"12"), (b"x-caf\xe9", b"\xe9t\xe9")],
]


def scope(headers: list[tuple[bytes, bytes]]) -> dict:
    return {
        "type": "http", "method": "POST", "path": "/v1/chat/completions", "root_path": "",
        "query_string": b"", "headers": headers, "client": ("10.1.2.3", 50000), "server": ("127.0.0.1", 8000),
    }  # fmt: skip


@pytest.mark.parametrize("headers", HEADER_SETS)
def test_headers_and_the_peer_read_as_djangos_request_reads_them(headers):
    ours = GatewayRequest(scope(headers), b"{}").META
    django = ASGIRequest(scope(headers), io.BytesIO(b"{}")).META
    assert {k: v for k, v in django.items() if k.startswith(("HTTP_", "CONTENT_"))} == {
        k: v for k, v in ours.items() if k.startswith(("HTTP_", "CONTENT_"))
    }
    assert ours["REMOTE_ADDR"] == django["REMOTE_ADDR"] == "10.1.2.3"


@pytest.mark.parametrize(
    ("host", "forwarded", "allowed", "use_forwarded"),
    [
        ("gw.example", None, ["gw.example"], False),
        ("gw.example:8443", None, ["gw.example"], False),
        ("evil.example", None, ["gw.example"], False),
        ("gw.example", "evil.example", ["gw.example"], True),
        ("gw.example", "evil.example", ["gw.example"], False),
        ("sub.gw.example", None, [".gw.example"], False),
        ("bad host", None, ["*"], False),
        (None, None, ["127.0.0.1"], False),  # no Host: the server's name and port
    ],
)
def test_the_host_rule_is_djangos(settings, host, forwarded, allowed, use_forwarded):
    settings.ALLOWED_HOSTS = allowed
    settings.USE_X_FORWARDED_HOST = use_forwarded
    headers = [(b"host", host.encode())] if host else []
    if forwarded:
        headers.append((b"x-forwarded-host", forwarded.encode()))
    try:
        ASGIRequest(scope(headers), io.BytesIO(b"")).get_host()
        django_allows = True
    except DisallowedHost:
        django_allows = False
    assert GatewayRequest(scope(headers), b"").host_allowed() is django_allows
