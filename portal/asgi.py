"""ASGI entry point, served by uvicorn.

`/v1/` (the OpenAI-compatible gateway) goes to the gateway's own ASGI application, without
Django's handler and page middleware (portal.gateway.asgi explains why); everything else to Django's.
Both refuse a body over their limit with a 413 before reading it whole, here at the edge
and nowhere else on the request's path.
"""

import gc
import os
from typing import cast

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
django_handler = get_asgi_application()

from django.conf import settings  # noqa: E402

from portal.batches.apis import upload_limit  # noqa: E402
from portal.core.bodylimit import App, BodyLimit  # noqa: E402
from portal.gateway import timing  # noqa: E402
from portal.gateway.asgi import GatewayHandler, body_refusal  # noqa: E402  (needs the apps loaded)
from portal.gateway.config import gateway_settings  # noqa: E402

# Neither stack reads a body past its limit (portal.core.bodylimit): the gateway's answer is OpenAI-shaped.
gateway_application = BodyLimit(
    GatewayHandler(), limit=lambda: gateway_settings().max_body_bytes, refusal=body_refusal
)
# `POST /v1/files` (a batch's input file) has a bound of its own, BATCH_FILE_MAX_BYTES.
upload_application = BodyLimit(GatewayHandler(), limit=upload_limit, refusal=body_refusal)
django_application = BodyLimit(
    cast(App, django_handler),  # its stubs type ASGI messages as Mappings, this module as dicts
    limit=lambda: settings.DATA_UPLOAD_MAX_MEMORY_SIZE,
    refusal=lambda limit: ("text/plain; charset=utf-8", f"Request body is over {limit} bytes.\n".encode()),
)

# Everything loaded so far (Django, the apps, their modules) lives as long as the process:
# keep it out of the garbage collector's full passes, so they do not walk the whole startup
# heap while streams are in flight, and collect the young generation less often under a
# streaming load that allocates many small short-lived objects.
gc.freeze()
gc.set_threshold(50_000, 20, 20)

# This process says which Redis namespace it uses (a split installation shows on the dashboard).
from portal.core.heartbeat import namespace_heartbeat_start  # noqa: E402

namespace_heartbeat_start("web")


async def application(scope, receive, send):
    if scope["type"] == "http" and scope["path"].startswith("/v1/"):
        if timing.ON:  # perf/gateway_overhead.py's per-step table
            timing.begin()
        if scope["path"] == "/v1/files" and scope["method"] == "POST":
            return await upload_application(scope, receive, send)
        return await gateway_application(scope, receive, send)
    return await django_application(scope, receive, send)
