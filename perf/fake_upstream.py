"""A small, fast OpenAI-compatible streaming server, for the gateway's tests and benchmark.

    python -m perf.fake_upstream --port 8199 [--chunks 32] [--interval-ms 5] [--model fake]

Serves `/v1/chat/completions` and `/v1/completions` (stream and not, with vLLM's
chunk shapes and the final usage chunk when `stream_options.include_usage`),
`/v1/models`, `/health`, and `/stats` (counters the tests read: started,
completed, disconnected, in_flight, in_prefill: before the first chunk). A
prompt containing `FAKE ` directives changes one request's behaviour, e.g.
`FAKE status=500`, `FAKE delay=3` (seconds before the first chunk),
`FAKE chunks=200 interval=20`, `FAKE die_after=3` (drop the connection after 3
chunks), `FAKE bad_usage=1` (usage reports `completion_tokens` as "three"; 2: `[3]`;
3: -1000; 4: 10**9, for the gateway's distrust of upstream numbers). A misconfigured replica, for
every request: `--status 401` answers that
status; `--empty` answers 200 and closes with no bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time

from aiohttp import web

DIRECTIVE = re.compile(r"FAKE((?:\s+\w+=[\d.]+)+)")
# What `FAKE bad_usage=N` reports as completion_tokens: what a broken or hostile engine might.
BAD_USAGE = {1: "three", 2: [3], 3: -1000, 4: 10**9}


def completion_usage(n: int, d: dict[str, float]) -> object:
    return BAD_USAGE[int(d["bad_usage"])] if "bad_usage" in d else n


def directives(body: dict) -> dict[str, float]:
    prompt = body.get("prompt")
    texts = [prompt] if isinstance(prompt, str) else [p for p in prompt or [] if isinstance(p, str)]
    for message in body.get("messages") or []:
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            texts.append(message["content"])
    found: dict[str, float] = {}
    for text in texts:
        for match in DIRECTIVE.finditer(text or ""):
            for pair in match.group(1).split():
                name, value = pair.split("=")
                found[name] = float(value)
    return found


def prompt_len(body: dict) -> int:
    text = body.get("prompt") if isinstance(body.get("prompt"), str) else ""
    for message in body.get("messages") or []:
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            text += message["content"]
    return max(1, len(text) // 4)


class Fake:
    def __init__(
        self, *, chunks: int, interval_s: float, model: str, status: int | None = None, empty: bool = False
    ) -> None:
        self.status = status  # every request answered this error status (a misconfigured replica)
        self.empty = empty  # every request answered 200 with an empty body
        self.chunks = chunks
        self.interval_s = interval_s
        self.model = model
        self.stats = {"started": 0, "completed": 0, "disconnected": 0, "in_flight": 0, "max_in_flight": 0,
                      "in_prefill": 0, "max_in_prefill": 0}  # fmt: skip
        self.last_body: dict | None = None
        self.last_authorization: str | None = None  # what the gateway sent upstream (its server key)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        try:
            body = await request.json()
        except ValueError:
            return web.json_response(
                {"error": {"message": "bad json", "type": "invalid_request_error"}}, status=400
            )
        self.last_body = body
        self.last_authorization = request.headers.get("Authorization")
        d = directives(body)
        if self.status is not None:
            d["status"] = self.status
        if self.empty:
            if body.get("stream"):
                response = web.StreamResponse(headers={"content-type": "text/event-stream; charset=utf-8"})
                await response.prepare(request)
                await response.write_eof()
                return response
            return web.Response(status=200, body=b"", content_type="application/json")
        if "status" in d:
            return web.json_response(
                {
                    "error": {
                        "message": f"fake {int(d['status'])}",
                        "type": "server_error",
                        "code": int(d["status"]),
                    }
                },
                status=int(d["status"]),
            )
        n = int(
            d.get(
                "chunks",
                min(self.chunks, body.get("max_tokens") or body.get("max_completion_tokens") or 10**9),
            )
        )
        interval = d.get("interval", self.interval_s * 1000) / 1000
        self.stats["started"] += 1
        self.stats["in_flight"] += 1
        self.stats["max_in_flight"] = max(self.stats["max_in_flight"], self.stats["in_flight"])
        try:
            # "Prefill": from arrival to the first chunk (the delay), as the long-prompt limiter sees it.
            self.stats["in_prefill"] += 1
            self.stats["max_in_prefill"] = max(self.stats["max_in_prefill"], self.stats["in_prefill"])
            try:
                if d.get("delay"):
                    await asyncio.sleep(d["delay"])
            finally:
                self.stats["in_prefill"] -= 1
            if body.get("stream"):
                return await self._stream(request, body, chat, n, interval, d)
            if interval:
                await asyncio.sleep(interval * n)
            text = "tok " * n
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                if chat
                else {"index": 0, "text": text, "finish_reason": "length"}
            )
            self.stats["completed"] += 1
            return web.json_response(
                {
                    "id": "cmpl-fake",
                    "object": "chat.completion" if chat else "text_completion",
                    "created": int(time.time()),
                    "model": body.get("model", self.model),
                    "choices": [choice],
                    "usage": {
                        "prompt_tokens": prompt_len(body),
                        "completion_tokens": completion_usage(n, d),
                        "total_tokens": prompt_len(body) + n,
                    },
                }
            )
        finally:
            self.stats["in_flight"] -= 1

    async def _stream(self, request, body, chat, n, interval, d) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        created = int(time.time())
        model = body.get("model", self.model)
        kind = "chat.completion.chunk" if chat else "text_completion"
        head = (
            f'data: {{"id":"chatcmpl-fake","object":"{kind}","created":{created},"model":"{model}",'
            '"choices":[{"index":0,'
        )
        chunk = (
            head
            + ('"delta":{"content":"tok "}' if chat else '"text":"tok "')
            + ',"finish_reason":null}]}\n\n'
        ).encode()
        last = (head + ('"delta":{}' if chat else '"text":""') + ',"finish_reason":"length"}]}\n\n').encode()
        die_after = int(d.get("die_after", -1))
        try:
            for i in range(n):
                if i == die_after:
                    request.transport.close()
                    return response
                await response.write(chunk)
                if interval:
                    await asyncio.sleep(interval)
            await response.write(last)
            if (body.get("stream_options") or {}).get("include_usage"):
                p = prompt_len(body)
                completion = completion_usage(n, d)
                usage = {"prompt_tokens": p, "completion_tokens": completion, "total_tokens": p + n}
                await response.write(
                    f'data: {{"id":"chatcmpl-fake","object":"{kind}","created":{created},"model":"{model}",'
                    f'"choices":[],"usage":{json.dumps(usage, separators=(",", ":"))}}}\n\n'.encode()
                )
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            self.stats["completed"] += 1
        except (ConnectionResetError, asyncio.CancelledError):
            self.stats["disconnected"] += 1
            raise
        return response

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def health(self, request):
        return web.Response(text="ok")

    async def get_stats(self, request):
        return web.json_response(
            {**self.stats, "last_body": self.last_body, "last_authorization": self.last_authorization}
        )

    async def reset(self, request):
        for name in self.stats:
            self.stats[name] = 0
        return web.json_response(self.stats)


def make_app(
    *,
    chunks: int = 32,
    interval_ms: float = 5,
    model: str = "fake",
    status: int | None = None,
    empty: bool = False,
) -> web.Application:
    fake = Fake(chunks=chunks, interval_s=interval_ms / 1000, model=model, status=status, empty=empty)
    app = web.Application()
    app.router.add_post("/v1/chat/completions", fake.handle)
    app.router.add_post("/v1/completions", fake.handle)
    app.router.add_get("/v1/models", fake.models)
    app.router.add_get("/health", fake.health)
    app.router.add_get("/stats", fake.get_stats)
    app.router.add_post("/stats/reset", fake.reset)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8199)
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--interval-ms", type=float, default=5)
    parser.add_argument("--model", default="fake")
    parser.add_argument("--status", type=int, default=None, help="answer every request with this status")
    parser.add_argument("--empty", action="store_true", help="answer every request 200 with no bytes")
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(
        make_app(
            chunks=args.chunks,
            interval_ms=args.interval_ms,
            model=args.model,
            status=args.status,
            empty=args.empty,
        ),
        host=args.host,
        port=args.port,
        print=None,
        access_log=None,
        handler_cancellation=True,
    )


if __name__ == "__main__":
    main()
