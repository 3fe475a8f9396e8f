"""Processes, ports and HTTP checks of one server, with real processes and sockets."""

import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from devtools import wait_until
from inference import server_log, supervisor
from inference.cuda_archs import missing_kernels, sm_name
from inference.env_probe import build_advice

# A parent that forks a child into its process group and ignores SIGTERM, like an engine that will not stop.
STUBBORN = (
    "import signal, subprocess, sys, time;"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN);"
    "subprocess.Popen([sys.executable, '-c', 'import signal, time;"
    " signal.signal(signal.SIGTERM, signal.SIG_IGN); print(\\'child ready\\', flush=True); time.sleep(60)']);"
    "print('ready', flush=True); time.sleep(60)"
)


def _wait_log(path, text, timeout=10):
    wait_until(
        lambda: path.exists() and text in path.read_text(), timeout_s=timeout, what=f"{text!r} in {path}"
    )


def _wait_zombie(pid: int, timeout=10) -> None:
    """Until the process has exited and waits, unreaped, as a zombie (state Z in /proc)."""

    def zombie() -> bool:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"

    wait_until(zombie, timeout_s=timeout, what=f"process {pid} exited")


def test_it_launches_in_a_new_process_group_with_the_gpus_and_a_log(tmp_path):
    log = tmp_path / "server.log"
    launched = supervisor.launch(
        [sys.executable, "-c", "import os; print('CVD=' + os.environ['CUDA_VISIBLE_DEVICES'], flush=True)"],
        log_path=log,
        cuda_visible_devices="2,3",
    )
    assert launched.pgid == launched.pid
    launched.process.wait(timeout=10)
    assert "CVD=2,3" in log.read_text()


def test_it_hides_every_gpu_with_an_empty_device_list(tmp_path):
    log = tmp_path / "server.log"
    launched = supervisor.launch(
        [sys.executable, "-c", "import os; print(repr(os.environ['CUDA_VISIBLE_DEVICES']))"],
        log_path=log,
        cuda_visible_devices="",
    )
    launched.process.wait(timeout=10)
    assert log.read_text().strip() == "''"


def test_it_kills_the_whole_group_with_sigkill_after_the_grace_period(tmp_path):
    log = tmp_path / "server.log"
    launched = supervisor.launch([sys.executable, "-c", STUBBORN], log_path=log, cuda_visible_devices="")
    _wait_log(log, "child ready")  # both ignore SIGTERM by now
    assert len(supervisor.group_members(launched.pgid)) == 2
    result = supervisor.stop_group(launched.pgid, grace_s=0.5)
    assert result.signal == "SIGKILL" and result.gone
    assert supervisor.group_members(launched.pgid) == []
    assert not supervisor.process_alive(launched.pid)


def test_it_stops_a_polite_group_with_sigterm(tmp_path):
    launched = supervisor.launch(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        log_path=tmp_path / "l",
        cuda_visible_devices="",
    )
    result = supervisor.stop_group(launched.pgid, grace_s=10)
    assert result.signal == "SIGTERM" and result.gone


def test_it_reports_nothing_to_stop_for_a_group_that_is_gone():
    assert supervisor.stop_group(None).signal == "none"
    assert not supervisor.group_alive(None)


def test_it_counts_a_zombie_as_dead(tmp_path):
    launched = supervisor.launch(
        [sys.executable, "-c", "pass"], log_path=tmp_path / "l", cuda_visible_devices=""
    )
    _wait_zombie(launched.pid)  # exited, not yet reaped by anyone
    assert not supervisor.process_alive(launched.pid)


def test_it_raises_when_the_executable_does_not_exist(tmp_path):
    with pytest.raises(FileNotFoundError):
        supervisor.launch(["/nonexistent/python", "-V"], log_path=tmp_path / "l", cuda_visible_devices="")


def test_it_tells_a_taken_port_from_a_free_one():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert not supervisor.port_is_free("127.0.0.1", port)
        assert not supervisor.wait_port_free("127.0.0.1", port, timeout_s=0.3)
    assert supervisor.port_is_free("127.0.0.1", port)
    assert supervisor.port_is_free("127.0.0.1", supervisor.find_free_port())


def test_it_reads_only_the_end_of_a_long_log(tmp_path):
    log = tmp_path / "l"
    log.write_text("".join(f"line {i}\n" for i in range(1000)))
    assert server_log.log_tail(log, lines=2) == "line 998\nline 999"
    assert server_log.log_tail(tmp_path / "missing") == ""


def test_it_stops_waiting_as_soon_as_the_server_exits():
    began = time.monotonic()
    with pytest.raises(supervisor.ServerExited) as error:
        supervisor.wait_until_ready(
            "http://127.0.0.1:9", "m", deadline_s=60, alive=lambda: False, returncode=lambda: 1
        )
    assert error.value.returncode == 1
    assert time.monotonic() - began < 2


def test_it_gives_up_at_the_deadline():
    with pytest.raises(supervisor.NotReady, match="/health"):
        supervisor.wait_until_ready(
            "http://127.0.0.1:9", "m", deadline_s=0.5, alive=lambda: True, interval_s=0.1
        )


@pytest.fixture
def server():
    """A tiny OpenAI-style server; `replies` sets what chat completions answer."""
    state = {"reply": "Hello!", "status": 200}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _send(self, status, body: bytes) -> None:
            self.send_response(status)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, b"")
            elif self.path == "/v1/models":
                self._send(200, b'{"data": [{"id": "m"}]}')
            elif self.path == "/metrics":
                self._send(200, b"vllm:num_requests_running 2\nvllm:num_requests_waiting 1\n")

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["content-length"]))
            import json

            body = {"choices": [{"message": {"content": state["reply"]}}]}
            self._send(state["status"], json.dumps(body).encode())

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    state["url"] = f"http://127.0.0.1:{httpd.server_address[1]}"
    yield state
    httpd.shutdown()


def test_it_is_ready_when_the_model_is_listed(server):
    healthy = []
    supervisor.wait_until_ready(
        server["url"], "m", deadline_s=5, alive=lambda: True, on_health=lambda: healthy.append(1)
    )
    assert healthy == [1]
    with pytest.raises(supervisor.NotReady, match="/v1/models"):
        supervisor.wait_until_ready(
            server["url"], "other", deadline_s=0.5, alive=lambda: True, interval_s=0.1
        )


def test_it_passes_a_sane_smoke_test_and_checks_the_expected_text(server):
    assert supervisor.smoke_test(server["url"], "m", expected_substring="hello") == "Hello!"
    with pytest.raises(supervisor.SmokeTestFailed, match="lacks 'Paris'"):
        supervisor.smoke_test(server["url"], "m", expected_substring="Paris")


def test_it_fails_an_empty_or_refused_smoke_test(server):
    server["reply"] = "   "
    with pytest.raises(supervisor.SmokeTestFailed, match="empty"):
        supervisor.smoke_test(server["url"], "m")
    server["status"] = 500
    with pytest.raises(supervisor.SmokeTestFailed, match="HTTP 500"):
        supervisor.smoke_test(server["url"], "m")


def test_it_scrapes_vllm_gauges(server):
    metrics = supervisor.scrape_metrics(server["url"])
    assert (metrics.running, metrics.waiting) == (2, 1)
    assert supervisor.check_health(server["url"])
    assert not supervisor.check_health("http://127.0.0.1:9", timeout_s=0.5)


def test_it_names_the_missing_kernels_and_the_build_to_install():
    cu128 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
    assert sm_name("7.0") == "sm_70"
    assert missing_kernels(cu128, ["7.0"]) == ["sm_70"]
    assert missing_kernels(["sm_70", "sm_75"], ["7.0"]) == []
    assert missing_kernels(["sm_60", "compute_60"], ["7.0"]) == []  # PTX can JIT for newer GPUs
    assert "cu126" in build_advice(["sm_70"])
