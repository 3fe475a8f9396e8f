"""One streamed chat request crosses between portal/gateway/ and portal/core/ only for the
mechanism core owns (the Redis client and keys, the script call records, the text check): the
admission lives in the gateway (docs/architecture.md, "Bottom and top"; issue 39)."""

from __future__ import annotations

import asyncio
import json

from portal.gateway.asgi import GatewayHandler
from tests.helpers.asgi import asgi_request
from tests.helpers.crossings import count_crossings
from tests.helpers.gateway import chat_body

# Module to module, gateway → core: the client factory, the key namespace, the script records,
# the text check of the NUL-refusing middleware. With the limiter in core there were 9, both ways.
MOST_CROSSINGS = 4


def test_a_chat_request_crosses_into_core_only_for_its_mechanism(serving, settings):
    settings.ALLOWED_HOSTS = ["127.0.0.1"]
    handler = GatewayHandler()
    headers = {**serving.headers, "content-type": "application/json"}
    body = json.dumps(chat_body(serving.model, "FAKE chunks=4 interval=1", stream=True)).encode()

    def one() -> list[dict]:
        return asyncio.run(asgi_request(handler, "POST", "/v1/chat/completions", headers, body))

    one()  # warm: the key, the route and the scripts are cached from now on, as in production
    sent: list[dict] = []
    crossings = count_crossings(lambda: sent.extend(one()), "portal/gateway", "portal/core")
    assert sent[0]["status"] == 200 and b"[DONE]" in b"".join(m.get("body", b"") for m in sent[1:])
    modules = sorted({(caller.split(":")[0], callee.split(":")[0]) for caller, callee in crossings})
    listed = "\n".join(f"  {caller} → {callee}" for caller, callee in modules)
    functions = "\n".join(f"  {a} → {b} ({n}×)" for (a, b), n in sorted(crossings.items()))
    print(f"\n{len(modules)} module crossings between portal/gateway and portal/core:\n{listed}")
    print(f"{len(crossings)} function crossings:\n{functions}")
    assert len(modules) <= MOST_CROSSINGS, listed
    assert all(caller.startswith("portal/gateway/") for caller, _callee in modules), "core calls the gateway"
