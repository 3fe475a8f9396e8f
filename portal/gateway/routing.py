"""Step 3: where a model is served. Model name → its serving replicas and tokenizer.

Read through `serving_deployments_for_model` and cached per process for
GATEWAY_CACHE_S seconds, so the database is read once per model per interval.
Which replica takes a request (least in flight, with room under its cap) is
decided in Redis by the admission step, across every web process.

A team's keys reach its own deployments and those marked `shared`, nothing else:
`Route.for_team` filters the cached replicas once per (model, team) and keeps the
result with the route. A model served only by another team's deployments looks
exactly like a registered model nobody serves (503 `no_replica`; absent from
`/v1/models`), so a key learns nothing about other teams' deployments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
    team_id: int
    shared: bool
    # Parsed once per route load, not per request (httpx re-parses a string URL every time).
    chat_url: httpx.URL
    completions_url: httpx.URL
    # The server's own key (VLLM_API_KEY), sent upstream as a bearer token; never the client's.
    api_key: str = field(default="", repr=False)
    context_len: int | None = None  # vLLM's max_model_len: prompt plus output (None: unknown)


@dataclass(frozen=True)
class Route:
    model: str
    registered: bool
    replicas: tuple[Replica, ...]  # every team's: use `for_team`
    tokenizer_path: str | None  # tokenizer.json of the model version, when it exists here
    _by_team: dict[int, tuple[Replica, ...]] = field(default_factory=dict, compare=False, repr=False)

    def for_team(self, team_id: int) -> tuple[Replica, ...]:
        """The replicas a key of `team_id` may use: its team's and the shared ones."""
        found = self._by_team.get(team_id)
        if found is None:
            found = self._by_team[team_id] = tuple(
                r for r in self.replicas if r.shared or r.team_id == team_id
            )
        return found


def smallest_context(replicas: tuple[Replica, ...]) -> int | None:
    """The smallest known context among `replicas`: a request may be placed on any of them."""
    return min((r.context_len for r in replicas if r.context_len), default=None)


_routes = TtlCache(lambda: settings.GATEWAY_CACHE_S, is_miss=lambda route: not route.registered)
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
            d.team_id,
            d.shared,
            httpx.URL(d.endpoint_url.rstrip("/") + "/v1/chat/completions"),
            httpx.URL(d.endpoint_url.rstrip("/") + "/v1/completions"),
            d.engine_api_key,
            d.context_len,
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


def _load_served() -> list[tuple[str, int, bool]]:
    close_old_connections()
    return sorted(
        set(
            Deployment.objects.filter(state="serving")
            .exclude(endpoint_url="")
            .values_list("model_version__name", "team_id", "shared")
        )
    )


async def served_models(team_id: int) -> list[str]:
    """Names of the models that `team_id`'s keys can reach (its own or shared replicas)."""
    try:
        rows = await _served.get("all", sync_to_async(_load_served))
    except DatabaseError:
        raise database_unavailable() from None
    return sorted({model for model, team, shared in rows if shared or team == team_id})
