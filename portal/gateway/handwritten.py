"""Every network layer the portal wrote by hand instead of using a library's, in one list.

Each was bought for speed (docs/decisions.md, "The gateway's own cost" passes) and leans on
details of a library that an upgrade may change. Before upgrading Django, uvicorn, httptools,
redis-py or hiredis, read this list: what each layer replaces, what it relies on (private
attributes included, by name) and the tests that fail when an upgrade breaks it.
`tests/gateway/test_handwritten.py` checks that every named test exists, that every named
attribute is still there in the installed library, and that the installed versions are the ones
these layers were last checked against (`checked_with`): an upgrade fails that test until
someone has read the layer again, run its tests and moved the version here.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Kind(StrEnum):
    PUBLIC = "public"  # a documented name whose behaviour the layer depends on in detail
    PRIVATE = "private"  # an underscore name, or a module the library calls internal
    BEHAVIOUR = "behaviour"  # no name to check: what the library does (its tests say whether it still does)


@dataclass(frozen=True)
class Reliance:
    """One thing a layer needs from a library. `owner` is a class or module attribute path inside
    `module` ("" for the module itself); `attribute` a name on it. An `instance` attribute is
    set in the owner's methods (`self.<attribute> =`), so it is looked for in their source."""

    library: str  # the distribution's name, as pip knows it
    module: str
    owner: str
    attribute: str
    kind: Kind
    why: str
    instance: bool = False


@dataclass(frozen=True)
class HandwrittenLayer:
    name: str
    module: str  # the repository path of the layer
    replaces: str
    relies_on: tuple[Reliance, ...]
    tests: tuple[str, ...]  # "path::test_name": those that fail when an upgrade breaks the layer
    checked_with: dict[str, str]  # distribution → the version the layer was last checked against


ASGI_HANDLER = HandwrittenLayer(
    name="the gateway's ASGI handler",
    module="portal/gateway/asgi.py",
    replaces="Django's ASGIHandler for /v1/ (its middleware and request signals, ~5.5 ms a request)",
    relies_on=(
        Reliance("Django", "django.urls", "", "get_resolver", Kind.PUBLIC, "the URLconf, resolved once"),
        Reliance("Django", "django.urls", "ResolverMatch", "func", Kind.PUBLIC, "the view", instance=True),
        Reliance(
            "Django", "django.http.request", "", "split_domain_port", Kind.PUBLIC,
            "ALLOWED_HOSTS as HttpRequest.get_host applies it",
        ),
        Reliance("Django", "django.http.request", "", "validate_host", Kind.PUBLIC, "the same"),
        Reliance(
            "uvicorn", "uvicorn.protocols.http.httptools_impl", "RequestResponseCycle", "response_complete",
            Kind.PRIVATE, "receive() answers http.disconnect once the response is complete: the "
            "handler then lets a stream's accounting end instead of cancelling it", instance=True,
        ),
        Reliance(
            "Django", "django.http", "StreamingHttpResponse", "__aiter__", Kind.PUBLIC,
            "RelayResponse hands its RelayStream to the server through it (no per-chunk wrapper), "
            "and Django's own handler (the playground) closes it with aclosing()",
        ),
        Reliance(
            "Python", "asyncio", "", "wait_for", Kind.BEHAVIOUR,
            "Python 3.11's wait_for may lose a cancellation (redis-py's socket timeout): "
            "`cancel_until_done` cancels again",
        ),
    ),
    tests=(
        "tests/gateway/test_handler_request.py::test_headers_and_the_peer_read_as_djangos_request_reads_them",
        "tests/gateway/test_handler_request.py::test_the_host_rule_is_djangos",
        "tests/gateway/test_handler_cancel.py::test_it_stops_a_view_that_lost_the_cancellation_of_a_client_that_left",
        "tests/gateway/test_handler_memory.py::test_a_finished_request_is_freed_by_reference_counting_alone",
        "tests/faults/test_stream_end_before_accounting.py::test_it_ends_the_stream_for_the_client_before_accounting_for_it",
    ),
    checked_with={"Django": "5.2.19", "uvicorn": "0.54.0"},
)  # fmt: skip

UPSTREAM_CLIENT = HandwrittenLayer(
    name="the HTTP/1.1 client to replicas",
    module="portal/gateway/upstream.py",
    replaces="httpx with the aiohttp transport (~0.3 ms of CPU a request before the first byte)",
    relies_on=(
        Reliance("httptools", "httptools", "", "HttpResponseParser", Kind.PUBLIC, "llhttp, uvicorn's parser"),
        Reliance("httptools", "httptools", "HttpResponseParser", "feed_data", Kind.PUBLIC, "bytes in"),
        Reliance("httptools", "httptools", "HttpResponseParser", "get_status_code", Kind.PUBLIC, "status"),
        Reliance(
            "httptools", "httptools", "HttpResponseParser", "should_keep_alive", Kind.PUBLIC,
            "whether a connection goes back to the pool",
        ),
        Reliance("httptools", "httptools", "", "HttpParserUpgrade", Kind.PUBLIC, "a 101 fails the request"),
        Reliance("httptools", "httptools", "", "HttpParserError", Kind.PUBLIC, "broken HTTP"),
        Reliance(
            "httptools", "httptools", "", "HttpResponseParser", Kind.BEHAVIOUR,
            "the callbacks on_message_begin, on_header, on_headers_complete, on_body, "
            "on_message_complete are called by name on the protocol object, interim (1xx) heads too",
        ),
    ),
    tests=(
        "tests/gateway/test_upstream_client.py::test_it_reuses_one_connection_for_answers_read_whole",
        "tests/gateway/test_upstream_client.py::test_an_answer_left_half_read_drops_its_connection_so_upstream_sees_the_disconnect",
        "tests/gateway/test_upstream_client.py::test_a_kept_connection_that_the_server_answers_unasked_and_closes_is_not_reused",
        "tests/gateway/test_hostile_upstream.py::test_it_skips_an_early_hints_head_so_each_caller_gets_its_own_answer",
        "tests/gateway/test_hostile_upstream.py::test_a_101_switching_protocols_fails_the_request_and_closes_its_connection",
        "tests/gateway/test_hostile_upstream.py::test_a_head_over_its_size_cap_is_refused_and_its_connection_closed",
    ),
    checked_with={"httptools": "0.9.0"},
)  # fmt: skip

REDIS_CONNECTION = HandwrittenLayer(
    name="the limiter's pipelined Redis connection",
    module="portal/gateway/admission/connection.py",
    replaces="redis-py's asyncio Script calls through its connection pool (~105 µs of CPU a call; ~52 here)",
    relies_on=(
        Reliance(
            "redis", "redis.asyncio.connection", "ConnectionPool", "connection_kwargs", Kind.PUBLIC,
            "the socket timeout and the decoding of the client's policy",
        ),
        Reliance(
            "redis", "redis.asyncio.connection", "ConnectionPool", "make_connection", Kind.PUBLIC,
            "a connection opened by the client's own class (TLS, AUTH, SELECT, Sentinel)",
        ),
        Reliance("redis", "redis.asyncio.client", "Redis", "get_retry", Kind.PUBLIC, "the client's Retry"),
        Reliance("redis", "redis.asyncio.retry", "Retry", "call_with_retry", Kind.PUBLIC, "redis-py's retry"),
        Reliance(
            "redis", "redis.asyncio.connection", "AbstractConnection", "_writer", Kind.PRIVATE,
            "the stream writer whose transport is taken over after connect()", instance=True,
        ),
        Reliance(
            "redis", "redis.asyncio.connection", "AbstractConnection", "_reader", Kind.PRIVATE,
            "let go of with _writer, so the connection neither closes nor warns of the transport",
            instance=True,
        ),
        Reliance(
            "redis", "redis._parsers.base", "BaseParser", "parse_error", Kind.PRIVATE,
            "an error reply as the exception redis-py raises (READONLY → ReadOnlyError, NOSCRIPT)",
        ),
        Reliance("hiredis", "hiredis", "", "Reader", Kind.PUBLIC, "the reply parser"),
        Reliance("hiredis", "hiredis", "", "pack_command", Kind.PUBLIC, "the command's bytes"),
    ),
    tests=(
        "tests/faults/test_redis_script_connection.py::test_concurrent_calls_share_one_connection_and_each_gets_its_own_reply",
        "tests/faults/test_redis_script_connection.py::test_a_cancelled_call_leaves_the_next_caller_its_own_reply",
        "tests/faults/test_redis_script_connection.py::test_a_hung_redis_is_a_timeout_then_a_new_connection_once_it_answers",
        "tests/faults/test_redis_script_connection.py::test_a_restarted_redis_is_reconnected_to_and_sent_the_script_again",
        "tests/faults/test_redis_connection_forms.py::test_the_limiters_script_connection_reaches_the_primary_through_sentinel",
        "tests/faults/test_redis_connection_forms.py::test_a_rediss_url_connects_with_tls",
    ),
    checked_with={"redis": "8.1.0", "hiredis": "3.5.0"},
)  # fmt: skip

BODY_LIMIT = HandwrittenLayer(
    name="the request body limit at the edge",
    module="portal/core/bodylimit.py",
    replaces="Django's DATA_UPLOAD_MAX_MEMORY_SIZE, which reads a chunked body whole before refusing it",
    relies_on=(
        Reliance(
            "Django", "django.core.handlers.asgi", "ASGIHandler", "read_body", Kind.BEHAVIOUR,
            "an http.disconnect while the body is read makes Django drop the request unanswered, "
            "so the middleware's own 413 is the only answer",
        ),
    ),
    tests=(
        "tests/gateway/test_body_limit.py::test_a_chunked_body_over_the_limit_is_refused_before_it_is_sent_whole",
        "tests/gateway/test_body_limit.py::test_the_pages_and_api_refuse_a_chunked_body_over_their_limit",
    ),
    checked_with={"Django": "5.2.19"},
)  # fmt: skip

LAYERS: tuple[HandwrittenLayer, ...] = (ASGI_HANDLER, UPSTREAM_CLIENT, REDIS_CONNECTION, BODY_LIMIT)
