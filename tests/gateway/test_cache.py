"""The gateway's per-process cache: misses are bounded apart from hits and never push them out."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from portal.gateway import cache as cache_module
from portal.gateway.cache import TtlCache


def test_it_keeps_real_keys_cached_through_a_flood_of_unknown_prefixes():
    loads: list[str] = []

    async def go():
        cache = TtlCache(lambda: 60, max_entries=5, max_misses=3)

        def loader(key):
            async def load():
                loads.append(key)
                return None if key.startswith("random") else f"row {key}"

            return load

        await cache.get("real", loader("real"))
        for i in range(50):
            assert await cache.get(f"random-{i}", loader(f"random-{i}")) is None
        return await cache.get("real", loader("real")), cache.peek("real")

    assert asyncio.run(go()) == ("row real", "row real")
    assert loads.count("real") == 1  # the 50 misses did not evict it


def test_it_evicts_the_oldest_miss_when_misses_are_full():
    loads: list[str] = []

    async def go():
        cache = TtlCache(lambda: 60, max_misses=3)

        def loader(key):
            async def load():
                loads.append(key)

            return load

        for key in ["a", "b", "c", "d", "d", "a"]:
            await cache.get(key, loader(key))

    asyncio.run(go())
    assert loads == ["a", "b", "c", "d", "a"]  # "a" went to make room for "d"; "d" stayed cached


def test_a_failed_refresh_serves_the_stale_entry_logs_why_and_the_next_load_replaces_it(caplog):
    outcomes = iter([RuntimeError("database gone"), "fresh"])

    async def go():
        cache = TtlCache(lambda: 0, name="routes")  # every hit is stale: each get starts a refresh

        async def first():
            return "stale"

        async def refresh():
            outcome = next(outcomes)
            if isinstance(outcome, Exception):
                raise outcome
            return outcome

        async def settle():  # one turn runs the refresh, the next its done-callback
            for _ in range(2):
                await asyncio.sleep(0)

        assert await cache.get("chat", first) == "stale"
        served = [await cache.get("chat", refresh)]  # the refresh fails behind it
        await settle()
        served.append(await cache.get("chat", refresh))  # tries again, and this one loads
        await settle()
        return served, cache.peek("chat")

    with caplog.at_level("WARNING", logger="portal.gateway"):
        served, cached = asyncio.run(go())
    assert served == ["stale", "stale"] and cached == "fresh"
    assert [r.getMessage() for r in caplog.records] == [
        "refreshing cached routes failed (RuntimeError: database gone); "
        "serving the stale entry until a load succeeds"
    ]


def test_after_a_failed_refresh_the_next_load_waits_one_interval(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(cache_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    loads: list[float] = []

    async def go():
        cache = TtlCache(lambda: 10.0, name="routes")

        async def load():
            loads.append(clock[0])
            if len(loads) > 1:
                raise RuntimeError("database gone")
            return "row"

        served = []
        for now in (0.0, 20.0, 25.0, 29.0, 31.0):  # stored at 0; stale at 20, where a refresh fails
            clock[0] = now
            served.append(await cache.get("chat", load))
            for _ in range(2):  # the refresh runs, then its done-callback
                await asyncio.sleep(0)
        return served

    assert asyncio.run(go()) == ["row"] * 5
    assert loads == [0.0, 20.0, 31.0]  # not at 25 or 29: within one interval of the failure


def test_it_waits_for_the_reload_of_an_entry_expired_longer_than_the_grace(monkeypatch):
    """After 30 s idle, a cap lowered to 1 once let 6 requests in at once from the old entry."""
    clock = [0.0]
    monkeypatch.setattr(cache_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    rows = iter(["cap 6", "cap 1"])

    async def go():
        cache = TtlCache(lambda: 10.0, name="routes", grace=lambda: 2.0)

        async def load():
            return next(rows)

        await cache.get("chat", load)
        clock[0] = 40.0
        return await cache.get("chat", load)

    assert asyncio.run(go()) == "cap 1"


def test_it_serves_an_entry_within_the_grace_while_one_load_refreshes_it(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(cache_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    rows = iter(["old", "new"])

    async def go():
        cache = TtlCache(lambda: 10.0, name="routes", grace=lambda: 2.0)

        async def load():
            return next(rows)

        await cache.get("chat", load)
        clock[0] = 11.5
        served = await cache.get("chat", load)
        for _ in range(2):  # the refresh runs, then its done-callback
            await asyncio.sleep(0)
        return served, cache.peek("chat")

    assert asyncio.run(go()) == ("old", "new")


def test_requests_of_an_entry_past_its_grace_all_wait_for_one_reload(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(cache_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    loads: list[float] = []

    async def go():
        cache = TtlCache(lambda: 10.0, name="model lists", grace=lambda: 2.0)
        release = asyncio.Event()

        async def load():
            loads.append(clock[0])
            if len(loads) > 1:
                await release.wait()  # a slow database: every request arrives while it runs
            return f"list of {clock[0]:g}"

        await cache.get("all", load)
        clock[0] = 300.0
        waiting = [asyncio.ensure_future(cache.get("all", load)) for _ in range(8)]
        await asyncio.sleep(0)
        release.set()
        return await asyncio.gather(*waiting)

    assert asyncio.run(go()) == ["list of 300"] * 8
    assert loads == [0.0, 300.0]


@pytest.mark.django_db(transaction=True)  # the route loads on a worker thread, with its own connection
def test_a_model_registered_while_the_gateway_idled_is_routed_at_its_next_request(monkeypatch, settings):
    """The routes cache answers from GATEWAY_CACHE_S + GATEWAY_CACHE_GRACE_S at most: a model
    unknown at the last load is found once that has passed, by the request that arrives."""
    from asgiref.sync import sync_to_async
    from django.db import connections

    from portal.gateway import routing
    from portal.registry.services import model_version_create
    from tests.helpers.samples import bundled_config

    settings.GATEWAY_CACHE_S, settings.GATEWAY_CACHE_GRACE_S = 10.0, 2.0
    clock = [1_000_000.0]
    monkeypatch.setattr(cache_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))

    async def registered() -> bool:
        try:
            return (await routing.route_for("registered-while-idle")).registered
        finally:  # the load's thread keeps its connection open otherwise
            await sync_to_async(connections.close_all)()

    assert not asyncio.run(registered())
    model_version_create(name="registered-while-idle", config=bundled_config("llama-2-7b-chat-hf"))
    clock[0] += 30  # idle: no request refreshed the entry
    assert asyncio.run(registered())
