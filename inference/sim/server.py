"""The simulator's OpenAI-compatible HTTP server (aiohttp), shaped like vLLM's api_server.

Endpoints: `/health`, `/v1/models`, `/v1/completions`, `/v1/chat/completions`
(streamed as server-sent events with a final usage chunk when
`stream_options.include_usage` is set, or as one JSON body), `/metrics`.

One engine task runs the same scheduler as the virtual-clock sweep, but on the
wall clock: it schedules a step, sleeps for the step's simulated duration
(divided by `speedup`), then hands each sampled token to its request's stream.

With an API key (`VLLM_API_KEY` in the environment, or `--api-key`) it guards what
vLLM guards: every path under `/v1` wants `Authorization: Bearer <key>` (401
otherwise); `/health`, `/ping`, `/version` and `/metrics` stay open, as in vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, cast

from aiohttp import web
from aiohttp.typedefs import Handler

from inference.sim.engine import SimEngine
from inference.sim.prometheus import SimMetrics
from inference.sim.scheduler import SimRequest
from inference.sim.tokens import Tokenizer, natural_length, output_text

logger = logging.getLogger(__name__)
SERVER_KEY: web.AppKey[SimServer] = web.AppKey("sim")

# Chat template overhead: Llama-2-chat wraps each message in [INST] … [/INST] markers.
CHAT_TOKENS_PER_MESSAGE = 4


@dataclass
class Stream:
    """What the HTTP handler of one request waits on."""

    queue: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)  # tokens so far; None: the end
    arrival: float = 0.0
    first_token: float | None = None
    last_token: float | None = None


class BadRequest(Exception):
    def __init__(
        self, message: str, *, status: int = 400, kind: str = "BadRequestError", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param


def error_response(error: BadRequest) -> web.Response:
    body = {"error": {"message": str(error), "type": error.kind, "param": error.param, "code": error.status}}
    return web.json_response(body, status=error.status)


class SimServer:
    def __init__(
        self,
        engine: SimEngine,
        *,
        served_model_names: list[str],
        tokenizer: Tokenizer,
        model_root: str,
        speedup: float = 1.0,
        api_key: str = "",
    ) -> None:
        self.engine = engine
        self.api_key = api_key
        self.names = served_model_names
        self.tokenizer = tokenizer
        self.model_root = model_root
        self.speedup = speedup
        self.metrics = SimMetrics(served_model_names[0])
        self.wakeup = asyncio.Event()
        # The API server's serial per-request work is done for one request at a time.
        self.front_end = asyncio.Lock()
        self.created = int(time.time())
        self._task: asyncio.Task[None] | None = None
        self.dead: str | None = None
        self._preemptions_seen = 0

    # --- the engine loop ---------------------------------------------------------
    async def start(self, app: web.Application) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self, app: web.Application) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        try:
            await self._steps()
        except asyncio.CancelledError:
            raise
        except Exception as error:
            # As vLLM's EngineDeadError: say why, fail what is in flight, answer 503 from now on.
            logger.exception("the simulated engine failed")
            self.dead = f"the engine failed: {type(error).__name__}: {error}"
            for request in [*self.engine.scheduler.running, *self.engine.scheduler.waiting]:
                cast(Stream, request.context).queue.put_nowait(None)

    async def _steps(self) -> None:
        loop = asyncio.get_running_loop()
        clock = loop.time()
        labels = self.metrics.labels
        while True:
            if not self.engine.has_work:
                self.wakeup.clear()
                await self.wakeup.wait()
                clock = loop.time()
            plan = self.engine.schedule()
            if not plan.scheduled:
                # Nothing fits yet (cannot happen with validated requests); do not spin.
                await asyncio.sleep(0.001)
                continue
            duration = self.engine.step_time(plan).total_s / self.speedup
            # Steps follow each other on a clock of their own, so the sleep's jitter
            # does not accumulate; a late wake-up is caught up by the next step.
            clock = max(clock, loop.time() - duration) + duration
            await asyncio.sleep(max(0.0, clock - loop.time()))
            outcome = self.engine.finish(plan)
            now = loop.time()
            for request in outcome.sampled:
                stream = cast(Stream, request.context)
                if stream.first_token is None:
                    stream.first_token = now
                    self.metrics.ttft.labels(**labels).observe((now - stream.arrival) * self.speedup)
                else:
                    gap = (now - (stream.last_token or now)) * self.speedup
                    self.metrics.itl.labels(**labels).observe(gap)
                    self.metrics.tpot.labels(**labels).observe(gap)
                stream.last_token = now
                stream.queue.put_nowait(request.num_output_tokens)
            for request in outcome.finished:
                stream = cast(Stream, request.context)
                self.metrics.e2e.labels(**labels).observe((now - stream.arrival) * self.speedup)
                self.metrics.success.labels(**labels, finished_reason=request.finish_reason).inc()
                stream.queue.put_nowait(None)
            self.metrics.generation_tokens.labels(**labels).inc(len(outcome.sampled))
            if outcome.prompt_tokens:
                self.metrics.prompt_tokens.labels(**labels).inc(outcome.prompt_tokens)
            preemptions = self.engine.scheduler.num_preemptions
            if preemptions > self._preemptions_seen:
                self.metrics.preemptions.labels(**labels).inc(preemptions - self._preemptions_seen)
                self._preemptions_seen = preemptions

    # --- HTTP ------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20, middlewares=[self.authenticate])
        app[SERVER_KEY] = self
        app.router.add_get("/health", self.health)
        app.router.add_get("/ping", self.health)
        app.router.add_get("/version", self.version)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.stop)
        return app

    @web.middleware
    async def authenticate(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """vLLM's check: with a key set, `/v1/*` wants `Authorization: Bearer <key>`."""
        if self.api_key and request.path.startswith("/v1") and request.method != "OPTIONS":
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.dead else 200, text=self.dead or "")

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "inference.sim"})

    async def models(self, request: web.Request) -> web.Response:
        data = [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "vllm",
                "root": self.model_root,
                "parent": None,
                "max_model_len": self.engine.max_model_len,
            }
            for name in self.names
        ]
        return web.json_response({"object": "list", "data": data})

    async def prometheus(self, request: web.Request) -> web.Response:
        kv = self.engine.kv
        self.metrics.update_gauges(
            running=len(self.engine.scheduler.running),
            waiting=len(self.engine.scheduler.waiting),
            kv_usage=kv.usage,
            queries=kv.prefix_queries,
            hits=kv.prefix_hits,
        )
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    # --- one request -------------------------------------------------------------------
    def _prompt_ids(self, body: dict[str, Any], chat: bool) -> list[int]:
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("messages must be a non-empty list", param="messages")
            ids: list[int] = []
            for message in messages:
                if not isinstance(message, dict):
                    raise BadRequest("each message must be an object", param="messages")
                content = message.get("content") or ""
                if isinstance(content, list):  # OpenAI content parts
                    content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
                if not isinstance(content, str):
                    raise BadRequest("message content must be a string", param="messages")
                ids.extend(self.tokenizer.encode(f"{message.get('role', 'user')}: {content}"))
                ids.extend([0] * CHAT_TOKENS_PER_MESSAGE)
            return ids
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise BadRequest("prompt must be a string or a list of token ids (one prompt)", param="prompt")

    @staticmethod
    def _int(body: dict[str, Any], key: str, default: int | None, low: int) -> int | None:
        value = body.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise BadRequest(f"{key} must be an integer ≥ {low}, got {value!r}", param=key)
        number: int = value
        return number

    async def _serve(self, http: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            body = await http.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error_response(BadRequest("the body is not valid JSON"))
        try:
            if self.dead:
                raise BadRequest(self.dead, status=503, kind="EngineDeadError")
            if not isinstance(body, dict):
                raise BadRequest("the body must be a JSON object")
            model = body.get("model")
            if model not in self.names:
                raise BadRequest(
                    f"The model `{model}` does not exist.", status=404, kind="NotFoundError", param="model"
                )
            if body.get("n", 1) != 1:
                raise BadRequest("the simulator serves n=1 only", param="n")
            prompt_ids = self._prompt_ids(body, chat)
            key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
            max_tokens = self._int(body, key, None, 1)
            min_tokens = self._int(body, "min_tokens", 0, 0) or 0
            refusal = self.engine.validate_request(len(prompt_ids), max_tokens)
            if refusal is not None:
                raise BadRequest(refusal)
            if max_tokens is None:
                max_tokens = self.engine.max_model_len - len(prompt_ids)
            if min_tokens > max_tokens:
                raise BadRequest(
                    f"min_tokens ({min_tokens}) must be ≤ max_tokens ({max_tokens})", param="min_tokens"
                )
        except BadRequest as error:
            return error_response(error)

        ignore_eos = bool(body.get("ignore_eos", False))
        seed = hash(tuple(prompt_ids[:64])) & 0x7FFFFFFF
        stream = Stream(arrival=asyncio.get_running_loop().time())
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        sim = SimRequest(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            max_tokens=max_tokens,
            stop_after=None if ignore_eos else natural_length(seed, max_tokens, min_tokens),
            context=stream,
        )
        # The API server's per-request work (a calibrated host cost) before the engine sees it.
        host = self.engine.config.host
        if host.api_serial_s_per_request > 0:
            async with self.front_end:
                await asyncio.sleep(host.api_serial_s_per_request / self.speedup)
        delay = host.api_s_per_request / self.speedup
        if delay > 0:
            await asyncio.sleep(delay)
        self.engine.add(sim)
        self.wakeup.set()
        streaming = bool(body.get("stream", False))
        options = body.get("stream_options") or {}
        include_usage = streaming and isinstance(options, dict) and bool(options.get("include_usage"))
        try:
            if streaming:
                return await self._stream(http, sim, stream, chat, seed, model, include_usage)
            return await self._whole(sim, stream, chat, seed, model)
        finally:
            if not sim.finished:
                self.engine.abort(sim)  # the client went away: free its blocks, as vLLM does

    def _usage(self, sim: SimRequest) -> dict[str, Any]:
        prompt = sim.num_prompt_tokens
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + sim.num_output_tokens,
            "completion_tokens": sim.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": sim.num_cached_tokens}
            if sim.num_cached_tokens
            else None,
        }

    async def _whole(
        self, sim: SimRequest, stream: Stream, chat: bool, seed: int, model: str
    ) -> web.Response:
        pieces = []
        while (index := await stream.queue.get()) is not None:
            pieces.append(output_text(seed, index - 1))
        if not sim.finished:
            return error_response(
                BadRequest(self.dead or "the request was dropped", status=500, kind="EngineDeadError")
            )
        text = "".join(pieces)
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": sim.finish_reason,
                "stop_reason": None,
            }
            kind = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": sim.finish_reason,
                "stop_reason": None,
            }
            kind = "text_completion"
        return web.json_response(
            {
                "id": sim.request_id,
                "object": kind,
                "created": int(time.time()),
                "model": model,
                "choices": [choice],
                "usage": self._usage(sim),
            }
        )

    async def _stream(
        self,
        http: web.Request,
        sim: SimRequest,
        stream: Stream,
        chat: bool,
        seed: int,
        model: str,
        include_usage: bool,
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(http)
        try:
            await self._stream_chunks(response, sim, stream, chat, seed, model, include_usage)
        except ConnectionResetError:
            # The client closed the stream early (aiohttp's ClientConnectionResetError): ordinary
            # traffic, not a server error, so one line instead of aiohttp's "Error handling request"
            # traceback. The caller aborts the request; the connection is closed as aiohttp would.
            tokens = sim.num_output_tokens
            logger.info("%s: the client closed the stream after %d tokens", sim.request_id, tokens)
            if http.transport is not None:
                http.transport.close()
        return response

    async def _stream_chunks(
        self,
        response: web.StreamResponse,
        sim: SimRequest,
        stream: Stream,
        chat: bool,
        seed: int,
        model: str,
        include_usage: bool,
    ) -> None:
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list[Any], usage: dict[str, Any] | None = None) -> bytes:
            data = {
                "id": sim.request_id,
                "object": kind,
                "created": created,
                "model": model,
                "choices": choices,
            }
            if usage is not None:
                data["usage"] = usage
            return f"data: {json.dumps(data)}\n\n".encode()

        first = True
        while (index := await stream.queue.get()) is not None:
            text = output_text(seed, index - 1)
            last = sim.finished and index == sim.num_output_tokens
            reason = sim.finish_reason if last else None
            if chat:
                if first:
                    # vLLM opens a chat stream with the role, once the first token exists.
                    role = {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    await response.write(chunk([role]))
                choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": reason}
            else:
                choice = {
                    "index": 0,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": reason,
                    "stop_reason": None,
                }
            first = False
            await response.write(chunk([choice]))
        if not sim.finished:
            error = {
                "message": self.dead or "the request was dropped",
                "type": "EngineDeadError",
                "code": 500,
            }
            await response.write(f"data: {json.dumps({'error': error})}\n\n".encode())
        elif include_usage:
            await response.write(chunk([], self._usage(sim)))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
