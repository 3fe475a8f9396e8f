"""The async streaming load generator: closed-loop levels at fixed concurrency, or open-loop Poisson.

One `run_sweep` call measures every level of a benchmark against an
OpenAI-compatible server's `/v1/completions` (streaming, `ignore_eos` +
`max_tokens` so output lengths are forced). It times requests exactly as vLLM's
`vllm bench serve` does (see `metrics`), and around each level it:
- excludes warm-up requests (by default one per virtual user);
- scrapes the server's `/metrics` before, during and after (preemptions, peak
  KV-cache usage, peak waiting and running requests, generated tokens);
- watches itself: its CPU use (share of one core: the event loop runs on one)
  and event-loop lag; a level where the client was the bottleneck is flagged;
- stops at a request count or after a duration; a level that hits its timeout,
  or a sweep that is cancelled, keeps what it measured and is marked partial.

Each request goes through the one streaming client (`inference.loadgen.client`).
Hooks let a caller (the Celery job, the command) follow progress and cancel; they
are called on the event loop thread and must not block.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import aiohttp

from inference.errors import InputError
from inference.loadgen.client import RequestInput, completion_body, stream_request
from inference.loadgen.prompts import EstimatingPromptBuilder, PromptBuilder, prompt_builder
from inference.loadgen.summary import RequestRecord, percentile, summarize_level
from inference.loadgen.workloads import Mix, RequestSpec, fit_to_context
from inference.vllm_metrics import VllmMetrics, parse_vllm_metrics

T = TypeVar("T")

# A level is client-bound when the load generator's event loop (one core) was this busy,
CLIENT_CPU_LIMIT = 0.90
# or when it woke this late (P95) from a short sleep while itself busy (≥ half a core):
# its timestamps are then late by as much, because of its own work.
LOOP_LAG_P95_LIMIT_MS = 10.0
LAGGING_CLIENT_CPU = 0.50
# The same lag with an idle client means other processes held the CPU (a shared host, or
# an engine on the same cores): noted on the level, but it is not the client's bottleneck.
LAG_PROBE_S = 0.02
DURATION_POOL = 512  # distinct requests cycled through by a duration-bound level
SAMPLE_CAP = 5000
CALIBRATION_TRIES = 3  # per-request samples kept per level for distribution plots


@dataclass(frozen=True)
class LevelPlan:
    """One level: closed loop at `concurrency`, or open loop at `request_rate` requests/s."""

    concurrency: int | None = None
    request_rate: float | None = None
    requests: int | None = None  # measured requests (warm-up not counted)
    duration_s: float | None = None
    warmup: int | None = None  # None: one per virtual user (open loop: 1)

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.request_rate is None):
            raise InputError("concurrency", "a level has either a concurrency or a request rate")
        if self.concurrency is not None and self.concurrency < 1:
            raise InputError("concurrency", "concurrency must be ≥ 1")
        if self.request_rate is not None and not self.request_rate > 0:
            raise InputError("request_rate", "the request rate must be > 0")
        if (self.requests is None) == (self.duration_s is None):
            raise InputError("requests_per_level", "a level runs for either a request count or a duration")
        if self.requests is not None and self.requests < 1:
            raise InputError("requests_per_level", "requests per level must be ≥ 1")
        if self.duration_s is not None and not self.duration_s > 0:
            raise InputError("duration_s", "the duration must be > 0")

    @property
    def warmup_requests(self) -> int:
        if self.warmup is not None:
            return self.warmup
        return self.concurrency or 1


@dataclass
class BenchConfig:
    base_url: str  # server root, e.g. http://127.0.0.1:8000 (the API is under /v1)
    model: str
    mix: Mix
    levels: list[LevelPlan]
    seed: int = 0
    tokenizer: str | None = None  # tokenizer.json or a directory holding one; None: estimate
    request_timeout_s: float = 600.0
    level_timeout_s: float | None = None  # None: no limit
    slo: dict[str, float] | None = None  # vLLM goodput config, ms
    scrape_interval_s: float = 1.0
    # Bearer token for every request: /v1/models, completions and /metrics (never in a repr).
    api_key: str | None = field(default=None, repr=False)
    calibrate: bool = True
    # The server whose /metrics is read, when requests go through a proxy (the portal's gateway):
    # the engine itself, with its own key. None: `base_url` and `api_key`.
    metrics_base_url: str | None = None
    metrics_api_key: str | None = field(default=None, repr=False)

    @property
    def root(self) -> str:
        return _root(self.base_url)

    @property
    def metrics_root(self) -> str:
        return _root(self.metrics_base_url) if self.metrics_base_url else self.root


def _root(url: str) -> str:
    root = url.rstrip("/")
    # Accept a URL given with /v1 (what OpenAI clients are configured with).
    return root[: -len("/v1")] if root.endswith("/v1") else root


class Hooks(Protocol):
    def level_started(self, index: int, plan: LevelPlan) -> None: ...
    def progress(self, index: int, done: int, planned: int | None) -> None: ...
    def level_finished(self, index: int, level: dict[str, Any]) -> None: ...
    def cancelled(self) -> bool: ...


class NoHooks:
    def level_started(self, index: int, plan: LevelPlan) -> None:
        pass

    def progress(self, index: int, done: int, planned: int | None) -> None:
        pass

    def level_finished(self, index: int, level: dict[str, Any]) -> None:
        pass

    def cancelled(self) -> bool:
        return False


@dataclass
class SweepResult:
    levels: list[dict[str, Any]] = field(default_factory=list)
    prompt_source: str = ""
    prompt_tokens_exact: bool = False
    prompt_token_offset: int = 0  # server count − our count (e.g. a BOS the tokenizer file does not add)
    max_model_len: int | None = None  # as the server's /v1/models reports it
    cancelled: bool = False
    error: str = ""  # why the sweep stopped early ("" when it ran every level)


def _headers(config: BenchConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}


async def preflight(session: aiohttp.ClientSession, config: BenchConfig) -> int | None:
    """Fail fast with a clear message when the server is unreachable or does not serve the model.

    Returns the model's context length where the server reports it (vLLM's `max_model_len`).
    """
    url = f"{config.root}/v1/models"
    try:
        timeout = aiohttp.ClientTimeout(total=10)
        async with session.get(url, headers=_headers(config), timeout=timeout) as response:
            if response.status != 200:
                raise InputError(
                    "url", f"{url} answered HTTP {response.status}: {(await response.text())[:200]}"
                )
            body = await response.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, OSError) as error:
        raise InputError("url", f"cannot reach {url}: {type(error).__name__}: {error}") from error
    except json.JSONDecodeError as error:
        raise InputError("url", f"{url} did not answer JSON: is this an OpenAI-compatible server?") from error
    served = [m.get("id") for m in body.get("data", []) if isinstance(m, dict)]
    if config.model not in served:
        serving = ", ".join(map(str, served)) or "nothing"
        raise InputError("model", f"{config.root} does not serve {config.model!r}; it serves: {serving}")
    entry = next(m for m in body["data"] if isinstance(m, dict) and m.get("id") == config.model)
    max_model_len = entry.get("max_model_len")
    return max_model_len if isinstance(max_model_len, int) and max_model_len > 0 else None


def request_input(config: BenchConfig, prompt: str, spec: RequestSpec) -> RequestInput:
    """One streamed completion with its output length forced, so runs compare."""
    return RequestInput(
        url=f"{config.root}/v1/completions",
        body=completion_body(config.model, prompt, max_tokens=spec.output_tokens),
        headers=_headers(config),
        timeout_s=config.request_timeout_s,
        prompt_tokens=spec.prompt_tokens,
    )


class ServerWatch:
    """Scrapes /metrics before, during and after a level; absent figures stay None."""

    def __init__(self, session: aiohttp.ClientSession, config: BenchConfig) -> None:
        self.session = session
        self.url = f"{config.metrics_root}/metrics"
        if config.metrics_base_url:
            key = config.metrics_api_key
            self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        else:
            self.headers = _headers(config)
        self.interval = config.scrape_interval_s
        self.before: VllmMetrics | None = None
        self.after: VllmMetrics | None = None
        self.peaks: dict[str, float | None] = {"kv_cache_usage": None, "waiting": None, "running": None}
        self.scrapes = 0
        self.failures = 0
        self.last_error = ""

    async def scrape(self) -> VllmMetrics | None:
        try:
            timeout = aiohttp.ClientTimeout(total=5)
            async with self.session.get(self.url, headers=self.headers, timeout=timeout) as response:
                if response.status != 200:
                    raise ValueError(f"HTTP {response.status}")
                metrics = parse_vllm_metrics(await response.text())
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as error:
            self.failures += 1
            self.last_error = f"{type(error).__name__}: {error}"
            return None
        self.scrapes += 1
        for name in self.peaks:
            value = getattr(metrics, name)
            if value is not None:
                peak = self.peaks[name]
                self.peaks[name] = value if peak is None else max(peak, value)
        return metrics

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.scrape()

    def summary(self) -> dict[str, Any]:
        def delta(name: str) -> float | None:
            a = getattr(self.before, name, None) if self.before else None
            b = getattr(self.after, name, None) if self.after else None
            return None if a is None or b is None else b - a

        return {
            "preemptions": delta("preemptions"),
            "server_generation_tokens": delta("generation_tokens"),
            "server_prompt_tokens": delta("prompt_tokens"),
            "kv_cache_peak": self.peaks["kv_cache_usage"],
            "waiting_peak": self.peaks["waiting"],
            "running_peak": self.peaks["running"],
            "metrics_scrapes": self.scrapes,
            "metrics_error": self.last_error if not self.scrapes else "",
        }


def judge_client(cpu_share: float | None, lag_p95_ms: float | None) -> tuple[str, str]:
    """(why the client was the bottleneck or "", a note that the host was busy or "")."""
    reasons = []
    busy = cpu_share is not None and cpu_share >= LAGGING_CLIENT_CPU
    lagging = lag_p95_ms is not None and lag_p95_ms >= LOOP_LAG_P95_LIMIT_MS
    if cpu_share is not None and cpu_share >= CLIENT_CPU_LIMIT:
        reasons.append(f"load generator CPU {cpu_share * 100:.0f} % of a core")
    if lagging and busy:
        reasons.append(f"event-loop lag P95 {lag_p95_ms:.1f} ms")
    host_note = ""
    if lagging and not busy:
        host_note = (
            f"event-loop lag P95 {lag_p95_ms:.0f} ms while the load generator used "
            f"{(cpu_share or 0) * 100:.0f} % of a core: other processes held the CPU"
        )
    return "; ".join(reasons), host_note


class SelfWatch:
    """The load generator's own CPU share and event-loop lag during a level."""

    def __init__(self) -> None:
        self.lags: list[float] = []

    async def probe(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(LAG_PROBE_S)
            self.lags.append(max(0.0, loop.time() - before - LAG_PROBE_S))

    def start(self) -> None:
        self.cpu0 = time.process_time()
        self.wall0 = time.perf_counter()

    def summary(self) -> dict[str, Any]:
        wall = time.perf_counter() - self.wall0
        cpu_share = (time.process_time() - self.cpu0) / wall if wall > 0 else None
        lag_p95 = percentile(self.lags, 95) * 1000 if self.lags else None
        lag_max = max(self.lags) * 1000 if self.lags else None
        client_bound_reason, host_note = judge_client(cpu_share, lag_p95)
        return {
            "client_cpu_share": cpu_share,
            "loop_lag_p95_ms": lag_p95,
            "loop_lag_max_ms": lag_max,
            "client_bound": bool(client_bound_reason),
            "client_bound_reason": client_bound_reason,
            "host_note": host_note,
        }


class _Level:
    """The state of one running level."""

    def __init__(self, config: BenchConfig, plan: LevelPlan, prompts: list[tuple[RequestSpec, str]]) -> None:
        self.config = config
        self.plan = plan
        self.prompts = prompts
        self.warmup = plan.warmup_requests
        self.planned = None if plan.requests is None else plan.requests + self.warmup
        self.dispatched = 0
        self.done = 0
        self.records: list[tuple[bool, RequestRecord]] = []  # (is warm-up, record)
        self.deadline: float | None = None
        self.stopped = False

    def next_request(self) -> tuple[bool, RequestSpec, str] | None:
        if self.stopped:
            return None
        if self.planned is not None and self.dispatched >= self.planned:
            return None
        now = time.perf_counter()
        if self.dispatched == self.warmup and self.plan.duration_s is not None and self.deadline is None:
            self.deadline = now + self.plan.duration_s
        if self.deadline is not None and now >= self.deadline:
            return None
        index = self.dispatched
        self.dispatched += 1
        spec, prompt = self.prompts[index % len(self.prompts)]
        return index < self.warmup, spec, prompt


async def _run_level(
    session: aiohttp.ClientSession,
    config: BenchConfig,
    plan: LevelPlan,
    prompts: list[tuple[RequestSpec, str]],
    index: int,
    hooks: Hooks,
) -> dict[str, Any]:
    state = _Level(config, plan, prompts)
    server = ServerWatch(session, config)
    client = SelfWatch()
    in_flight: set[asyncio.Task[None]] = set()

    async def one(warm: bool, spec: RequestSpec, prompt: str) -> None:
        record = RequestRecord(start=time.perf_counter())
        state.records.append((warm, record))
        await stream_request(session, request_input(config, prompt, spec), record)
        state.done += 1
        hooks.progress(index, state.done, state.planned)

    async def user() -> None:
        while (item := state.next_request()) is not None:
            await one(*item)

    async def poisson() -> None:
        assert plan.request_rate is not None  # a level has a concurrency or a rate (LevelPlan)
        rng = random.Random(config.seed)  # noqa: S311 (reproducible arrivals, not security)
        while (item := state.next_request()) is not None:
            task = asyncio.create_task(one(*item))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
            await asyncio.sleep(rng.expovariate(plan.request_rate))
        if in_flight:
            await asyncio.gather(*in_flight)

    async def cancel_watch() -> None:
        while not hooks.cancelled():
            await asyncio.sleep(0.2)

    server.before = await server.scrape()
    hooks.level_started(index, plan)
    client.start()
    background = [asyncio.create_task(server.watch()), asyncio.create_task(client.probe())]
    work: asyncio.Future[Any]
    if plan.concurrency is not None:
        work = asyncio.gather(*(user() for _ in range(plan.concurrency)))
    else:
        work = asyncio.ensure_future(poisson())
    watcher = asyncio.create_task(cancel_watch())
    partial_reason = ""
    done, _ = await asyncio.wait(
        {work, watcher}, timeout=config.level_timeout_s, return_when=asyncio.FIRST_COMPLETED
    )
    if work not in done:
        partial_reason = (
            "cancelled" if watcher in done else f"level timeout after {config.level_timeout_s:g} s"
        )
        state.stopped = True
        work.cancel()
        for task in list(in_flight):
            task.cancel()
        await asyncio.gather(work, *in_flight, return_exceptions=True)
    watcher.cancel()
    client_summary = client.summary()
    for task in background:
        task.cancel()
    await asyncio.gather(*background, watcher, return_exceptions=True)
    server.after = await server.scrape()

    measured: list[RequestRecord] = []
    for warm, record in state.records:
        if warm:
            continue
        if record.error == "cancelled":
            record.error = f"unfinished: {partial_reason}"
        measured.append(record)
    warmup = [record for warm, record in state.records if warm]
    level = summarize_level(measured, concurrency=plan.concurrency, slo=config.slo, warmup=warmup)
    level.update(
        mode="closed" if plan.concurrency is not None else "open",
        request_rate=plan.request_rate,
        planned_requests=plan.requests,
        planned_duration_s=plan.duration_s,
        warmup_requests=sum(1 for warm, _ in state.records if warm),
        partial=bool(partial_reason),
        partial_reason=partial_reason,
    )
    level.update(server.summary())
    level.update(client_summary)
    ok = [r for r in measured if r.ok][:SAMPLE_CAP]
    level["samples"] = {
        "ttft_ms": [round(r.ttft * 1000, 3) for r in ok],
        "tpot_ms": [round(r.tpot * 1000, 3) for r in ok if r.tpot is not None],
        "e2el_ms": [round(r.e2el * 1000, 3) for r in ok],
        "output_tokens": [r.output_tokens for r in ok],
    }
    return level


async def _calibrate(
    session: aiohttp.ClientSession, config: BenchConfig, builder: PromptBuilder | EstimatingPromptBuilder
) -> tuple[int, str]:
    """Send one short request: the server's prompt count tells us its special tokens (and warms it up)."""
    probe = RequestSpec(prompt_tokens=64, output_tokens=1)
    prompt = builder.build(probe, seed=-1)
    record = RequestRecord(start=0.0)
    await stream_request(session, request_input(config, prompt, probe), record)
    if record.error:
        return 0, f"calibration request failed: {record.error}"
    server_count = record.prompt_tokens
    if isinstance(builder, EstimatingPromptBuilder):
        if server_count > 0:
            builder.chars_per_token = builder.chars_per_token * server_count / probe.prompt_tokens
        return 0, ""
    return server_count - probe.prompt_tokens, ""


def _build_prompts(
    builder: PromptBuilder | EstimatingPromptBuilder,
    mix: Mix,
    plan: LevelPlan,
    *,
    seed: int,
    offset: int,
    max_model_len: int | None = None,
) -> list[tuple[RequestSpec, str]]:
    count = plan.requests + plan.warmup_requests if plan.requests is not None else DURATION_POOL
    specs = [fit_to_context(spec, max_model_len) for spec in mix.sample(count, seed=seed)]
    prompts = []
    for i, spec in enumerate(specs):
        target = RequestSpec(
            spec.prompt_tokens - offset,
            spec.output_tokens,
            spec.prefix_group,
            max(0, spec.shared_prefix_tokens - offset),
        )
        prompts.append((spec, builder.build(target, seed=seed * 1_000_003 + i)))
    return prompts


async def run_sweep(config: BenchConfig, hooks: Hooks | None = None) -> SweepResult:
    """Measure every level in order; raises InputError for bad input found before the first level."""
    hooks = hooks or NoHooks()
    if not config.levels:
        raise InputError("concurrency", "no levels to run")
    builder: PromptBuilder | EstimatingPromptBuilder = prompt_builder(config.tokenizer)
    result = SweepResult(prompt_source=builder.source, prompt_tokens_exact=builder.exact)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
        result.max_model_len = await preflight(session, config)
        if config.calibrate:
            # A server that fails some requests should still be measured: a few tries.
            for _ in range(CALIBRATION_TRIES):
                result.prompt_token_offset, problem = await _calibrate(session, config, builder)
                if not problem:
                    break
            if problem:
                raise InputError("url", f"{problem} ({CALIBRATION_TRIES} tries)")
            result.prompt_source = builder.source  # the estimate is rescaled by calibration
        for index, plan in enumerate(config.levels):
            if hooks.cancelled():
                result.cancelled = True
                result.error = "cancelled before this level"
                break
            prompts = _build_prompts(
                builder,
                config.mix,
                plan,
                seed=config.seed,
                offset=result.prompt_token_offset,
                max_model_len=result.max_model_len,
            )
            level = await _run_level(session, config, plan, prompts, index, hooks)
            level["prompt_tokens_exact"] = builder.exact
            level["max_model_len"] = result.max_model_len
            result.levels.append(level)
            hooks.level_finished(index, level)
            if level["partial"]:
                result.cancelled = level["partial_reason"] == "cancelled"
                result.error = f"level {index + 1} stopped early: {level['partial_reason']}"
                if result.cancelled:
                    break
    return result


def run_blocking(coroutine: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(coroutine)`, also when this thread already runs an event loop (a caller inside
    async code, or Playwright's sync API in a test session): then on a fresh thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    outcome: dict[str, Any] = {}  # "value": T, or "error"

    def target() -> None:
        try:
            outcome["value"] = asyncio.run(coroutine)
        except BaseException as error:  # handed back to the caller's thread below
            outcome["error"] = error

    thread = threading.Thread(target=target, name="bench-event-loop")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    value: T = outcome["value"]
    return value
