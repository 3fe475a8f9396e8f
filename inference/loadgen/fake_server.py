"""A deterministic OpenAI-compatible streaming server with known delays, for checking benchmarks.

`/v1/completions` streams `max_tokens` tokens: the first `first_token_s` after
the request arrives, then one every `token_interval_s` (scheduled on absolute
times so sleeps do not drift), then a usage chunk and `[DONE]`, in vLLM's
shapes. Prompt tokens are counted as whitespace-separated words (a stand-in;
the usage chunk reports that count). It also serves `/v1/models`, `/health` and
a `/metrics` with vLLM's metric names. Faults for tests: every `fail_every`-th
request answers HTTP 500; `chunk_tokens` > 1 sends several tokens per chunk.

Run it standalone: `python -m inference.loadgen.fake_server --port 8100 --first-token-ms 50 --token-ms 10`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from aiohttp import web
from aiohttp.typedefs import Handler


class FakeServer:
    def __init__(
        self,
        *,
        model: str = "fake",
        first_token_s: float = 0.05,
        token_interval_s: float = 0.01,
        fail_every: int = 0,
        chunk_tokens: int = 1,
        api_key: str = "",
    ) -> None:
        self.model = model
        self.api_key = api_key  # as vLLM's VLLM_API_KEY: /v1/* wants it as a bearer token
        self.first_token_s = first_token_s
        self.token_interval_s = token_interval_s
        self.fail_every = fail_every
        self.chunk_tokens = max(1, chunk_tokens)
        self.received = 0
        self.running = 0
        self.generated = 0
        self.prompt_tokens = 0
        self.finished = 0

    def app(self) -> web.Application:
        """The aiohttp app; serve it with `web.AppRunner(app, access_log=None)`: logging costs per request."""
        app = web.Application(middlewares=[self.authenticate] if self.api_key else [])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        return app

    @web.middleware
    async def authenticate(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        given = request.headers.get("Authorization")
        if request.path.startswith("/v1") and given != f"Bearer {self.api_key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def metrics(self, request: web.Request) -> web.Response:
        labels = f'{{model_name="{self.model}"}}'
        kv_usage = min(1.0, self.running / 64)
        text = (
            f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{labels} {self.running}\n"
            f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{labels} 0\n"
            f"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{labels} {kv_usage}\n"
            f"# TYPE vllm:num_preemptions counter\nvllm:num_preemptions_total{labels} 0\n"
            f"# TYPE vllm:prompt_tokens counter\nvllm:prompt_tokens_total{labels} {self.prompt_tokens}\n"
            f"# TYPE vllm:generation_tokens counter\nvllm:generation_tokens_total{labels} {self.generated}\n"
            f"# TYPE vllm:request_success counter\nvllm:request_success_total{labels} {self.finished}\n"
        )
        return web.Response(text=text, content_type="text/plain")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        arrived = time.perf_counter()
        body = await request.json()
        self.received += 1
        if self.fail_every and self.received % self.fail_every == 0:
            return web.json_response(
                {"error": {"message": "injected failure", "type": "InternalServerError", "code": 500}},
                status=500,
            )
        if body.get("model") != self.model:
            return web.json_response(
                {"error": {"message": f"model {body.get('model')!r} not found"}}, status=404
            )
        prompt = body.get("prompt") or ""
        prompt_tokens = len(prompt.split()) if isinstance(prompt, str) else len(prompt)
        max_tokens = int(body.get("max_tokens") or 16)
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        self.running += 1
        self.prompt_tokens += prompt_tokens
        try:
            sent = 0
            while sent < max_tokens:
                # Token k (0-based) is due at arrival + first_token + k × interval.
                batch = min(self.chunk_tokens, max_tokens - sent)
                due = arrived + self.first_token_s + (sent + batch - 1) * self.token_interval_s
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                chunk = {
                    "id": "cmpl-fake",
                    "object": "text_completion",
                    "model": self.model,
                    "choices": [{"index": 0, "text": " tok" * batch, "finish_reason": None}],
                }
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
                sent += batch
                self.generated += batch
            usage = {
                "id": "cmpl-fake",
                "object": "text_completion",
                "model": self.model,
                "choices": [],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": max_tokens,
                    "total_tokens": prompt_tokens + max_tokens,
                },
            }
            if (body.get("stream_options") or {}).get("include_usage"):
                await response.write(f"data: {json.dumps(usage)}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            self.finished += 1
        finally:
            self.running -= 1
        return response


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--model", default="fake")
    parser.add_argument("--first-token-ms", type=float, default=50.0)
    parser.add_argument("--token-ms", type=float, default=10.0)
    args = parser.parse_args()
    server = FakeServer(
        model=args.model, first_token_s=args.first_token_ms / 1000, token_interval_s=args.token_ms / 1000
    )
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(server.app(), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
