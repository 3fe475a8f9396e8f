"""The suite's hooks (a pytest plugin, tests/conftest.py): markers that mark, skip or fail.

- A test that asks for `vllm_server` is a `vllm` test whether or not it says so, so
  `make test-fast` (`-m "not vllm ..."`) never starts the engine.
- `gpu`: skipped where `nvidia-smi -L` lists no GPU.
- `postgres`: needs PostgreSQL (processes sharing the test database). Skipped on another
  database locally; in CI (CI=true) that is a failure, so CI can never pass by skipping it.
- Browser tests run last (see `_BrowserTestsLast`).
"""

from __future__ import annotations

import os

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def skip_or_fail_in_ci(message: str) -> None:
    """Skip a test whose requirement is missing here; in CI a missing requirement is a failure."""
    if in_ci():
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the markers added here count
def pytest_collection_modifyitems(config, items):
    for item in items:
        if "vllm_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.vllm)
    gpu_tests = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu_tests:
        from tests.helpers.engines import gpu_available

        if not gpu_available():
            for item in gpu_tests:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (nvidia-smi lists none)"))


def pytest_runtest_setup(item):
    marker = item.get_closest_marker("postgres")
    if marker is None:
        return
    from django.db import connection

    if connection.vendor != "postgresql":
        reason = marker.kwargs.get("reason", "processes that share the test database")
        skip_or_fail_in_ci(f"needs PostgreSQL ({reason}); the test database is {connection.vendor}")


class _BrowserTestsLast:
    """Run the real-browser tests last, after pytest-django has ordered tests by database use.

    Playwright's sync API keeps an asyncio event loop running in the main thread
    for as long as its session-wide browser lives; any later `asyncio.run()` (the
    gateway, the load generator, the simulator) or async-to-sync call in that
    thread would then fail. After the browser starts, only browser tests follow.
    (A hook of its own: the marker hook above must run first, this one last.)
    """

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        items.sort(key=lambda item: item.get_closest_marker("browser") is not None)


def pytest_configure(config):
    config.pluginmanager.register(_BrowserTestsLast(), "portal-browser-tests-last")
