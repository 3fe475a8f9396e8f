"""Does `BENCHMARK_GATEWAY_URL` reach this portal's gateway? Asked once when the benchmarks worker
starts, so a wrong host or port is a line in the log at start rather than every member's run failing."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import httpx
from django.conf import settings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatewayCheck:
    url: str
    answers: bool  # this portal's gateway answered (its keyless 401 in the gateway's JSON shape)
    detail: str


def benchmark_gateway_check(url: str | None = None, *, timeout_s: float = 3.0) -> GatewayCheck:
    """Ask `url` (default: BENCHMARK_GATEWAY_URL) for /v1/models without a key: this portal's gateway
    answers 401 with its JSON error; anything else is not the gateway members' runs need."""
    url = (url or settings.BENCHMARK_GATEWAY_URL).rstrip("/")
    try:
        response = httpx.get(f"{url}/v1/models", timeout=timeout_s)
    except httpx.HTTPError as error:
        return GatewayCheck(url, False, f"nothing answers at {url} ({type(error).__name__}: {error})")
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.status_code == 401 and isinstance(body, dict) and isinstance(body.get("error"), dict):
        return GatewayCheck(url, True, f"this portal's gateway answers at {url}")
    return GatewayCheck(
        url, False, f"{url}/v1/models answered HTTP {response.status_code}, not this portal's gateway"
    )


def benchmark_gateway_check_at_start(*, within_s: float = 60.0, every_s: float = 2.0) -> threading.Thread:
    """In the background (the web process may start after the worker): log that the gateway answers,
    or, if it never does within `within_s`, an error naming the setting to fix."""

    def check() -> None:
        deadline = time.monotonic() + within_s
        while True:
            result = benchmark_gateway_check()
            if result.answers:
                logger.info("Benchmarks: %s (BENCHMARK_GATEWAY_URL).", result.detail)
                return
            if time.monotonic() >= deadline:
                logger.error(
                    "Benchmarks: %s. Members' benchmarks will fail: set BENCHMARK_GATEWAY_URL to this "
                    "portal's address (unset, it is http://127.0.0.1:$PORTAL_PORT).",
                    result.detail,
                )
                return
            time.sleep(every_s)  # a start-up poll in its own thread, not a test wait

    thread = threading.Thread(target=check, name="benchmark-gateway-check", daemon=True)
    thread.start()
    return thread
