"""The gateway's per-process cache: misses are bounded apart from hits and never push them out."""

from __future__ import annotations

import asyncio

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
