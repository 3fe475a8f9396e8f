"""devtools with real sockets and processes: ports, waits that name what did not answer, stopping groups."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread

import pytest

from devtools import (
    NotReady,
    children_of,
    free_port,
    log_tail,
    spawn,
    stop,
    stop_all,
    wait_for_http,
    wait_for_tcp,
    wait_until,
)

# A parent that ignores SIGTERM and forks a child into its group that ignores it too.
STUBBORN = """
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if os.fork() == 0:
    time.sleep(600)
print("started", flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_it_gives_a_port_that_can_be_bound():
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_wait_for_tcp_returns_once_something_listens():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        wait_for_tcp("127.0.0.1", listener.getsockname()[1], timeout_s=5)


def test_wait_for_tcp_names_the_address_that_did_not_answer():
    port = free_port()
    with pytest.raises(NotReady, match=rf"^not answering on 127\.0\.0\.1:{port} after 0\.3 s$"):
        wait_for_tcp("127.0.0.1", port, timeout_s=0.3)


def test_wait_for_http_waits_for_the_status_asked_for():
    answers = iter([503, 503, 200])

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(next(answers, 200))
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/health"
        wait_for_http(url, status=200, timeout_s=10)
        assert next(answers, "spent") == "spent"  # it asked until the 200
    finally:
        server.shutdown()


def test_wait_for_http_fails_at_once_naming_the_process_that_exited(tmp_path):
    process = spawn(
        [sys.executable, "-c", "print('bad config'); raise SystemExit(3)"], log=tmp_path / "x.log"
    )
    began = time.monotonic()
    with pytest.raises(NotReady, match=r"not answering at .*: the process exited with 3\nbad config"):
        wait_for_http(
            f"http://127.0.0.1:{free_port()}/", watch=process, timeout_s=60,
            details=lambda: log_tail(tmp_path / "x.log"),
        )  # fmt: skip
    assert time.monotonic() - began < 10


def test_wait_until_names_which_of_several_processes_exited():
    alive = spawn([sys.executable, "-c", "import time; time.sleep(600)"])
    dead = spawn([sys.executable, "-c", "raise SystemExit(7)"])
    try:
        with pytest.raises(NotReady, match=r"^not ready: beat exited with 7$"):
            wait_until(lambda: False, what="ready", watch={"web": alive, "beat": dead}, timeout_s=60)
    finally:
        stop(alive)


def test_spawn_captures_the_log_and_stop_returns_the_exit_code(tmp_path):
    log = tmp_path / "server.log"
    process = spawn([sys.executable, "-c", "import sys, time; print('up'); print('err', file=sys.stderr,"
                     " flush=True); time.sleep(600)"], log=log)  # fmt: skip
    wait_until(lambda: "err" in log.read_text(), what="both streams in the log", timeout_s=10)
    assert stop(process, grace_s=5) == -signal.SIGTERM
    assert log_tail(log).splitlines() == ["up", "err"]
    assert stop(process) == -signal.SIGTERM  # a second stop of a stopped process does not raise


def test_stop_kills_a_group_that_ignores_sigterm_children_included(tmp_path):
    log = tmp_path / "stubborn.log"
    process = spawn([sys.executable, "-c", STUBBORN], log=log)
    wait_until(lambda: "started" in log.read_text() and children_of(process.pid), what="forked", timeout_s=10)
    child = children_of(process.pid)[0]
    began = time.monotonic()
    assert stop(process, grace_s=0.5) == -signal.SIGKILL
    assert time.monotonic() - began < 5
    wait_until(lambda: not _alive(child), what="the child gone with its group", timeout_s=5)


def test_stop_all_signals_every_group_before_waiting_for_any():
    processes = [
        spawn([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, lambda *a: "
               "(time.sleep(1), exit(0))); print(flush=True); time.sleep(600)"], stdout=subprocess.PIPE)
        for _ in range(3)
    ]  # fmt: skip
    for process in processes:
        process.stdout.readline()  # its handler is in place
    began = time.monotonic()
    assert stop_all(processes, grace_s=10) == [0, 0, 0]
    assert time.monotonic() - began < 2.5  # side by side: about 1 s, not 3


def test_log_tail_of_a_missing_log_says_so(tmp_path):
    assert log_tail(tmp_path / "never.log") == "(no log)"
    assert log_tail(None) == "(no log)"


def test_nothing_the_portal_or_the_engine_side_runs_imports_devtools():
    import ast

    from tests.helpers import ROOT

    offending = []
    for top in ("portal", "inference"):
        for path in sorted((ROOT / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = (
                    [alias.name for alias in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
                )  # fmt: skip
                if any(name.split(".")[0] == "devtools" for name in names):
                    offending.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offending == [], "devtools is for tests, perf and scripts only:\n" + "\n".join(offending)
