"""Step 3: where a model is served. Model name → its serving replicas and tokenizer.

Read through `serving_deployments_for_model` and cached per process for
GATEWAY_CACHE_S seconds, so the database is read once per model per interval.
Which replica takes a request (least in flight, with room under its cap) is
decided in Redis by the admission step, across every web process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections

from portal.deployments.models import Deployment
from portal.deployments.selectors import serving_deployments_for_model
from portal.registry.models import ModelVersion


@dataclass(frozen=True)
class Replica:
    id: int
    name: str
    base_url: str
    cap: int | None


@dataclass(frozen=True)
class Route:
    model: str
    registered: bool
    replicas: tuple[Replica, ...]
    tokenizer_path: str | None  # tokenizer.json of the model version, when it exists here


_routes: dict[str, tuple[float, Route]] = {}
_served: list[float | list[str]] = [0.0, []]


def _load_route(model: str) -> Route:
    close_old_connections()  # the gateway handler sends no request signals (gateway/asgi.py)
    version = ModelVersion.objects.filter(name=model).only("path").first()
    if version is None:
        return Route(model, False, (), None)
    replicas = tuple(
        Replica(d.pk, d.name, d.endpoint_url.rstrip("/"), d.concurrency_cap)
        for d in serving_deployments_for_model(model).order_by("pk")
    )
    tokenizer = Path(version.path) / "tokenizer.json" if version.path else None
    return Route(model, True, replicas, str(tokenizer) if tokenizer and tokenizer.is_file() else None)


async def route_for(model: str) -> Route:
    now = time.monotonic()
    hit = _routes.get(model)
    if hit is not None and now - hit[0] < settings.GATEWAY_CACHE_S:
        return hit[1]
    route = await sync_to_async(_load_route)(model)
    if len(_routes) > 10_000:
        _routes.clear()
    _routes[model] = (now, route)
    return route


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
    now = time.monotonic()
    if now - _served[0] >= settings.GATEWAY_CACHE_S:
        _served[:] = [now, await sync_to_async(_load_served)()]
    return _served[1]
