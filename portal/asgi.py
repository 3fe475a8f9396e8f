"""ASGI entry point, served by uvicorn.

`/v1/` (the OpenAI-compatible gateway) goes to a lean Django handler without the
page middleware (portal.gateway.asgi explains why); everything else to Django's.
"""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
django_application = get_asgi_application()

from portal.gateway.asgi import GatewayHandler  # noqa: E402  (needs the apps loaded)

gateway_application = GatewayHandler()


async def application(scope, receive, send):
    if scope["type"] == "http" and scope["path"].startswith("/v1/"):
        return await gateway_application(scope, receive, send)
    return await django_application(scope, receive, send)
