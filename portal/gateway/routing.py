"""Step 3: where a model is served. Model name → its serving replicas and tokenizer.

Read through `serving_deployments_for_model` and cached per process for
GATEWAY_CACHE_S seconds, so the database is read once per model per interval.
Which replica takes a request (least in flight, with room under its cap) is
decided in Redis by the admission step, across every web process.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import Error as DatabaseError
from django.db import close_old_connections

from portal.deployments.models import Deployment
from portal.deployments.selectors import serving_deployments_for_model
from portal.registry.models import ModelVersion

from .cache import TtlCache
from .errors import database_unavailable


@dataclass(frozen=True)
class Replica:
    id: int
    name: str
    base_url: str
    cap: int | None
    # Parsed once per route load, not per request (httpx re-parses a string URL every time).
    chat_url: httpx.URL
    completions_url: httpx.URL


@dataclass(frozen=True)
class Route:
    model: str
    registered: bool
    replicas: tuple[Replica, ...]
    tokenizer_path: str | None  # tokenizer.json of the model version, when it exists here


_routes = TtlCache(lambda: settings.GATEWAY_CACHE_S)
_served = TtlCache(lambda: settings.GATEWAY_CACHE_S)


def _load_route(model: str) -> Route:
    close_old_connections()  # the gateway handler sends no request signals (gateway/asgi.py)
    version = ModelVersion.objects.filter(name=model).only("path").first()
    if version is None:
        return Route(model, False, (), None)
    replicas = tuple(
        Replica(
            d.pk,
            d.name,
            d.endpoint_url.rstrip("/"),
            d.concurrency_cap,
            httpx.URL(d.endpoint_url.rstrip("/") + "/v1/chat/completions"),
            httpx.URL(d.endpoint_url.rstrip("/") + "/v1/completions"),
        )
        for d in serving_deployments_for_model(model).order_by("pk")
    )
    tokenizer = Path(version.path) / "tokenizer.json" if version.path else None
    return Route(model, True, replicas, str(tokenizer) if tokenizer and tokenizer.is_file() else None)


async def route_for(model: str) -> Route:
    try:
        return await _routes.get(model, lambda: sync_to_async(_load_route)(model))
    except DatabaseError:
        raise database_unavailable() from None


def _load_served() -> list[str]:
    close_old_connections()
    return sorted(
        set(
            Deployment.objects.filter(state="serving")
            .exclude(endpoint_url="")
            .values_list("model_version__name", flat=True)
        )
    )


async def served_models() -> list[str]:
    try:
        return await _served.get("all", sync_to_async(_load_served))
    except DatabaseError:
        raise database_unavailable() from None
