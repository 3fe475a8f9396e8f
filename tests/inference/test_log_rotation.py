"""The engine log is bounded: copy-truncate while the server writes, keep N old copies."""

from __future__ import annotations

import sys

from devtools import wait_until
from inference import server_log, supervisor

# Writes a numbered line every 5 ms to stdout (the log file, through the descriptor `launch` opened).
CHATTY = (
    "import itertools, time\n"
    "for i in itertools.count():\n"
    "    print(f'line {i:06d}', flush=True)\n"
    "    time.sleep(0.005)"
)


def _wait_size(path, size: int, timeout: float = 20) -> None:
    wait_until(
        lambda: path.stat().st_size >= size,
        timeout_s=timeout,
        what=f"{path} at {size} bytes",
        interval_s=0.02,
    )


def test_it_rotates_a_log_the_server_keeps_writing_without_holes(tmp_path):
    log = tmp_path / "server.log"
    launched = supervisor.launch([sys.executable, "-c", CHATTY], log_path=log, cuda_visible_devices="")
    try:
        _wait_size(log, 2000)
        assert server_log.rotate_log(log, max_bytes=1000, keep=2)
        first_copy = (tmp_path / "server.log.1").read_text()
        assert first_copy.startswith("line 000000\n")
        assert log.stat().st_size < len(first_copy)
        _wait_size(log, 2000)
        assert server_log.rotate_log(log, max_bytes=1000, keep=2)
        _wait_size(log, 2000)
        assert server_log.rotate_log(log, max_bytes=1000, keep=2)
    finally:
        supervisor.stop_group(launched.pgid, grace_s=5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["server.log", "server.log.1", "server.log.2"]
    # The writer's O_APPEND descriptor lands at the new end: no NUL-filled hole where the old content was.
    for path in tmp_path.iterdir():
        data = path.read_bytes()
        assert b"\0" not in data
        numbers = [int(line.split()[1]) for line in data.decode().splitlines()]
        assert numbers == sorted(numbers)
    assert (tmp_path / "server.log.2").read_text() != first_copy  # the oldest copy was dropped


def test_it_leaves_a_log_under_the_limit_alone(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("short\n")
    assert not server_log.rotate_log(log, max_bytes=1000, keep=2)
    assert not server_log.rotate_log(tmp_path / "missing.log", max_bytes=1000, keep=2)
    assert log.read_text() == "short\n"


def test_it_only_truncates_when_no_copy_is_kept(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("x" * 2000)
    assert server_log.rotate_log(log, max_bytes=1000, keep=0)
    assert log.read_text() == "" and list(tmp_path.iterdir()) == [log]


def test_it_retires_the_previous_runs_log_keeping_n(tmp_path):
    log = tmp_path / "server.log"
    for run in range(4):
        log.write_text(f"run {run}\n")
        server_log.retire_log(log, keep=2)
    assert not log.exists()
    assert (tmp_path / "server.log.1").read_text() == "run 3\n"
    assert (tmp_path / "server.log.2").read_text() == "run 2\n"
    assert not (tmp_path / "server.log.3").exists()
