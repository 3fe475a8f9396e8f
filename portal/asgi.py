"""ASGI entry point, served by uvicorn.

`/v1/` (the OpenAI-compatible gateway) goes to a lean Django handler without the
page middleware (portal.gateway.asgi explains why); everything else to Django's.
"""

import gc
import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
django_application = get_asgi_application()

from portal.gateway.asgi import GatewayHandler  # noqa: E402  (needs the apps loaded)

gateway_application = GatewayHandler()

# Everything loaded so far (Django, the apps, their modules) lives as long as the process:
# keep it out of the garbage collector's full passes, so they do not walk the whole startup
# heap while streams are in flight, and collect the young generation less often under a
# streaming load that allocates many small short-lived objects.
gc.freeze()
gc.set_threshold(50_000, 20, 20)


async def application(scope, receive, send):
    if scope["type"] == "http" and scope["path"].startswith("/v1/"):
        return await gateway_application(scope, receive, send)
    return await django_application(scope, receive, send)
