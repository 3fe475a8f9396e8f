"""A recorded pid/pgid is signalled only while it is still the process launched (item: stale pids).

After a node reboot, or once the server is gone, the same number can belong to an
unrelated process or lead an unrelated process group. These tests stand in for that
with a real process whose recorded identity is from another boot or another start.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys

import pytest

from devtools import wait_until
from inference import supervisor
from inference.supervisor import ProcessIdentity


@pytest.fixture
def stranger():
    """An unrelated process leading its own process group (what a reused pgid would be)."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    yield process
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


def _wait_identity(pid: int) -> ProcessIdentity:
    def started() -> ProcessIdentity | None:
        identity = supervisor.process_identity(pid)
        return identity if identity is not None and identity.cmdline and "-c" in identity.cmdline else None

    return wait_until(started, timeout_s=10, what=f"an identity for {pid}", interval_s=0.02)


def test_it_records_boot_start_time_and_command_line_at_launch(tmp_path):
    argv = [sys.executable, "-c", "import time; time.sleep(30)"]
    launched = supervisor.launch(argv, log_path=tmp_path / "l", cuda_visible_devices="")
    try:
        identity = launched.identity
        assert identity is not None
        assert identity.boot_id == supervisor.boot_id() != ""
        assert identity.start_ticks > 0
        assert identity.cmdline == tuple(argv)
        assert ProcessIdentity.from_dict(identity.to_dict()) == identity
        assert supervisor.process_alive(launched.pid, identity)
        assert supervisor.group_alive(launched.pgid, identity)
    finally:
        supervisor.stop_group(launched.pgid, grace_s=5)


def test_it_never_signals_a_group_recorded_in_another_boot(stranger):
    recorded = dataclasses.replace(_wait_identity(stranger.pid), boot_id="a-boot-before-the-reboot")
    assert not supervisor.group_alive(stranger.pid, recorded)
    assert not supervisor.process_alive(stranger.pid, recorded)
    result = supervisor.stop_group(stranger.pid, grace_s=1, identity=recorded)
    assert result.signal == "none" and result.gone
    assert stranger.poll() is None  # the unrelated process lives on


def test_it_never_signals_a_pid_that_now_is_another_process(stranger):
    identity = _wait_identity(stranger.pid)
    started_other_time = dataclasses.replace(identity, start_ticks=identity.start_ticks - 1)
    assert supervisor.stop_group(stranger.pid, grace_s=1, identity=started_other_time).signal == "none"
    assert supervisor.group_rss_mb(stranger.pid, started_other_time) is None
    assert stranger.poll() is None
    # Its own identity: that is the process, and it is stopped.
    assert supervisor.stop_group(stranger.pid, grace_s=5, identity=identity).gone
    assert stranger.poll() is not None


def test_it_compares_command_lines_when_the_boot_id_cannot_tell_reboots_apart(stranger, monkeypatch):
    monkeypatch.setattr(supervisor, "boot_id", lambda: "")
    identity = _wait_identity(stranger.pid)
    assert identity.boot_id == ""
    other_command = dataclasses.replace(identity, cmdline=("/opt/vllm/bin/python", "-m", "vllm"))
    assert supervisor.stop_group(stranger.pid, grace_s=1, identity=other_command).signal == "none"
    assert stranger.poll() is None
    assert supervisor.process_alive(stranger.pid, identity)


def test_it_still_knows_its_server_after_the_server_retitles_itself(stranger):
    """vLLM may setproctitle: same boot and start time is the same process, whatever argv says."""
    retitled = dataclasses.replace(_wait_identity(stranger.pid), cmdline=("VLLM::APIServer",))
    assert supervisor.process_alive(stranger.pid, retitled)
    assert supervisor.group_alive(stranger.pid, retitled)


def test_it_still_stops_engine_processes_left_after_their_leader_died(tmp_path):
    """Same boot, leader gone: the pgid cannot have been reused while members remain."""
    script = (
        "import subprocess, sys, time;"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
        "print('forked', flush=True)"
    )
    log = tmp_path / "l"
    launched = supervisor.launch([sys.executable, "-c", script], log_path=log, cuda_visible_devices="")
    launched.process.wait(10)  # the "API server" exits, its "engine core" child stays
    assert not supervisor.process_alive(launched.pid, launched.identity)
    assert supervisor.group_alive(launched.pgid, launched.identity)
    assert supervisor.stop_group(launched.pgid, grace_s=5, identity=launched.identity).gone
    assert supervisor.group_members(launched.pgid) == []
