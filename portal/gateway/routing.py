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

A served model name (registry.ServedModel, `chat-7b`) is not a version: its route carries
the routes of its versions with a share above 0 (`Route.split`), loaded together and cached
together, so every process draws with the same shares within one cache interval. Each request
draws a version on its own (`Route.pick`), among the versions this team can reach, weighted by
share; the rest of the pipeline then runs on that version's route as if it had been asked for.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from asgiref.sync import sync_to_async
from django.db import Error as DatabaseError
from django.db import close_old_connections

from portal.deployments.selectors import served_replicas, serving_deployments_for_model, team_reaches
from portal.registry.models import ModelVersion, ServedModel, ServedModelVersion

from .cache import TtlCache
from .config import gateway_settings
from .errors import database_unavailable


@dataclass(frozen=True)
class Replica:
    id: int
    name: str
    base_url: str
    cap: int | None
    team_id: int
    shared: bool
    # Split once per process by upstream.target (cached by URL).
    chat_url: str
    completions_url: str
    # The server's own key (VLLM_API_KEY), sent upstream as a bearer token; never the client's.
    api_key: str = field(default="", repr=False)
    context_len: int | None = None  # vLLM's max_model_len: prompt plus output (None: unknown)


@dataclass(frozen=True)
class Route:
    model: str
    registered: bool
    replicas: tuple[Replica, ...]  # every team's: use `for_team`
    tokenizer_path: str | None  # tokenizer.json of the model version, when it exists here
    # A served model name: (share in basis points, the version's route) for each version above 0.
    split: tuple[tuple[int, Route], ...] = ()
    _by_team: dict[int, tuple[Replica, ...]] = field(default_factory=dict, compare=False, repr=False)

    def for_team(self, team_id: int) -> tuple[Replica, ...]:
        """The replicas a key of `team_id` may use: its team's and the shared ones."""
        found = self._by_team.get(team_id)
        if found is None:
            found = self._by_team[team_id] = tuple(
                r for r in self.replicas if team_reaches(team_id, owner_team_id=r.team_id, shared=r.shared)
            )
        return found

    def pick(self, team_id: int, draw: random.Random | None = None, *, pinned: int | None = None) -> Route:
        """The version route that serves one request of `team_id` (itself when not a served name):
        a draw weighted by share among the versions with a replica this team may use. A key
        `pinned` to one deployment (a member's benchmark) gets that deployment's version, never a
        draw that would leave it no replica."""
        if not self.split:
            return self
        if pinned is not None:
            for _, route in self.split:
                if any(r.id == pinned for r in route.for_team(team_id)):
                    return route
        reachable = [(share, route) for share, route in self.split if route.for_team(team_id)]
        if not reachable:
            return self  # no version is serving for this team: the caller answers 503 no_replica
        roll = (draw or random).random() * sum(share for share, _ in reachable)
        for share, route in reachable:
            roll -= share
            if roll < 0:
                return route
        return reachable[-1][1]


def smallest_context(replicas: tuple[Replica, ...]) -> int | None:
    """The smallest known context among `replicas`: a request may be placed on any of them."""
    return min((r.context_len for r in replicas if r.context_len), default=None)


_routes = TtlCache(
    lambda: gateway_settings().cache_s,
    name="routes",
    is_miss=lambda route: not route.registered,
    grace=lambda: gateway_settings().cache_grace_s,
)
_served = TtlCache(
    lambda: gateway_settings().cache_s, name="model lists", grace=lambda: gateway_settings().cache_grace_s
)


def _load_route(model: str) -> Route:
    close_old_connections()  # the gateway handler sends no request signals (gateway/asgi.py)
    served = ServedModel.objects.filter(name=model).first()
    if served is not None:
        return _load_served_route(served)
    if ModelVersion.objects.filter(name=model, callable_by_name=False).exists():
        return Route(model, False, (), None)  # reachable through a served name only: unknown by its own
    return _load_version_route(model)


def _load_served_route(served: ServedModel) -> Route:
    rows = (
        ServedModelVersion.objects.filter(served_model=served, share_bp__gt=0)
        .select_related("model_version")
        .order_by("model_version__name")
    )
    split = tuple((row.share_bp, _load_version_route(row.model_version.name)) for row in rows)
    replicas = tuple(replica for _, route in split for replica in route.replicas)
    return Route(served.name, True, replicas, None, split)


def _load_version_route(model: str) -> Route:
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
            d.endpoint_url.rstrip("/") + "/v1/chat/completions",
            d.endpoint_url.rstrip("/") + "/v1/completions",
            d.engine_api_key,
            d.context_len,
        )
        for d in serving_deployments_for_model(model).order_by("pk")
    )
    tokenizer = Path(version.path) / "tokenizer.json" if version.path else None
    return Route(model, True, replicas, str(tokenizer) if tokenizer and tokenizer.is_file() else None)


async def route_for(model: str) -> Route:
    try:
        route: Route = await _routes.get(model, lambda: sync_to_async(_load_route)(model))
        return route
    except DatabaseError:
        raise database_unavailable() from None


def _load_served() -> list[tuple[str, int, bool]]:
    close_old_connections()
    reachable = {(replica.model, replica.team_id, replica.shared) for replica in served_replicas()}
    # A served name is reachable where one of its versions with a share is.
    by_version: dict[str, list[str]] = {}
    for served, version in ServedModelVersion.objects.filter(share_bp__gt=0).values_list(
        "served_model__name", "model_version__name"
    ):
        by_version.setdefault(version, []).append(served)
    names = {
        (name, team, shared) for version, team, shared in reachable for name in by_version.get(version, ())
    }
    hidden = set(ModelVersion.objects.filter(callable_by_name=False).values_list("name", flat=True))
    return sorted({row for row in reachable if row[0] not in hidden} | names)


async def served_models(team_id: int) -> list[str]:
    """Names of the models that `team_id`'s keys can reach (its own or shared replicas)."""
    try:
        rows = await _served.get("all", sync_to_async(_load_served))
    except DatabaseError:
        raise database_unavailable() from None
    return sorted(
        {model for model, team, shared in rows if team_reaches(team_id, owner_team_id=team, shared=shared)}
    )
