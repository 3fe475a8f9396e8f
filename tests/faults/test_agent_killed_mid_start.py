"""The node agent (a Celery worker) is killed in the middle of a deployment start.

Two ways it dies, each while the start waits for the engine's /health:

- `agent`: the whole worker (main process and pool child) is SIGKILLed, as by the OOM killer or
  a host crash, and a new agent is started on the same queue. The start message was taken but not
  acknowledged (acks_late): Redis keeps it in its `unacked` hash and hands it out again only after
  CELERY_VISIBILITY_TIMEOUT (2 h), so the recovery comes from supervision (beat), which the new
  agent runs: once the dead agent's lease lapses, it stops the half-started server's process group
  and starts a new one. When the old message does come back, it finds the deployment serving.
- `child`: only the pool process running the start dies; the worker's main process survives,
  rejects the message (task_reject_on_worker_lost) and its new pool process gets it again at once.

Either way the deployment ends `serving` with exactly one engine process group, and the group the
dead agent launched is gone. The engine is the stand-in (tests/deployments/fake_engine), launched
by the real path (own process group, health wait): what is under test is the agent, the lease and
the process groups, not vLLM, and a real start costs 40-90 s of the shared cores where this one
costs a second; the real engine's death and restart are test_vllm_dies_mid_stream.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from devtools import children_of, stop, wait_until
from inference import supervisor
from portal.core.redis.client import redis_keys
from portal.deployments.agent.start import deployment_start
from portal.deployments.models import Deployment
from portal.deployments.tasks import start_deployment, supervise_node
from tests.helpers import ROOT
from tests.helpers.builders import make_deployment
from tests.helpers.deployments import FAKE_ENGINE
from tests.helpers.processes import engine_groups

from .conftest import shared_database_url

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.faults]

LEASE_TTL_S = 3


def start_agent(queue: str, run_dir: Path, log_path: Path) -> subprocess.Popen:
    """The node agent as the Procfile runs it (prefork, one process)."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DATABASE_URL": shared_database_url(),
        "PORTAL_RUN_DIR": str(run_dir),
        "PYTHONPATH": str(FAKE_ENGINE),
        "DEPLOYMENT_LEASE_TTL_S": str(LEASE_TTL_S),
        "DEPLOYMENT_RESTART_BACKOFF_S": "0.5",
        "DEPLOYMENT_STOP_GRACE_S": "5",
        "DEPLOYMENT_READY_TIMEOUT_S": "120",
    }
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "portal", "worker", "-Q", queue,
             "-n", f"{queue}-{time.time()}@%h", "--concurrency", "1", "--loglevel", "INFO",
             "--without-mingle", "--without-gossip"],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


@pytest.mark.timeout(180)
@pytest.mark.parametrize("killed", ["agent", "child"])
@pytest.mark.postgres(reason="an agent process shares the test database")
def test_a_start_interrupted_by_a_killed_agent_ends_with_exactly_one_engine(
    killed, team, tiny_version, tiny_profile, fake_node, run_dir, reap_servers, settings, tmp_path
):
    settings.DEPLOYMENT_LEASE_TTL_S = LEASE_TTL_S
    queue = fake_node.queue
    broker = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    broker.delete(redis_keys().celery_key(queue))
    log_path = tmp_path / "agent.log"
    agent = start_agent(queue, run_dir, log_path)
    beat_stop = threading.Event()
    try:
        deployment = make_deployment(team, tiny_version, tiny_profile, fake_node, desired_state="stopped")
        (run_dir / deployment.name).mkdir(parents=True)
        (run_dir / deployment.name / "startup_s").write_text("60")  # the kill lands while it starts
        Deployment.objects.filter(pk=deployment.pk).update(desired_state="running", state="pending")
        message_id = start_deployment.apply_async(args=[deployment.pk], queue=queue).id
        wait_until(
            lambda: Deployment.objects.get(pk=deployment.pk).pgid,
            timeout_s=60,
            what="launched",
            interval_s=0.2,
        )
        orphan = Deployment.objects.get(pk=deployment.pk).pgid
        (run_dir / deployment.name / "startup_s").write_text("0.3")  # the next start is quick
        killed_at = time.monotonic()
        if killed == "agent":
            os.killpg(agent.pid, signal.SIGKILL)  # the worker and its pool; the server has its own session
            agent.wait(timeout=10)
            # The start message is not lost: Redis keeps it, unacknowledged, for its late redelivery.
            unacked = broker.hvals(redis_keys().celery_key("unacked"))
            assert message_id in [json.loads(v)[0]["headers"]["id"] for v in unacked]
            agent = start_agent(queue, run_dir, log_path)  # the agent comes back (systemd, honcho, a person)
        else:
            (child,) = [
                p for p in children_of(agent.pid) if b"celery" in Path(f"/proc/{p}/cmdline").read_bytes()
            ]
            os.kill(child, signal.SIGKILL)
        assert supervisor.group_alive(orphan)  # the half-started server outlived its agent

        # What beat does every DEPLOYMENT_SUPERVISE_INTERVAL_S, at a test's pace.
        def beat() -> None:
            while not beat_stop.wait(1.5):
                supervise_node.apply_async(args=[fake_node.name], queue=queue, expires=3)

        threading.Thread(target=beat, daemon=True).start()
        serving = wait_until(
            lambda: (d := Deployment.objects.get(pk=deployment.pk)).state == "serving" and d,
            timeout_s=90,
            what="serving again",
            interval_s=0.2,
        )
        recovered_s = time.monotonic() - killed_at
        time.sleep(2)  # a few more supervision passes: nothing may start a second server
        beat_stop.set()

        groups = engine_groups(run_dir)
        events = [f"{e.step} {e.status} {e.message}" for e in serving.events.order_by("at")]
        print(f"\n[{killed}] serving {recovered_s:.1f} s after the kill; engine groups {groups}; timeline:")
        print("\n".join(f"  {line}" for line in events))
        assert not supervisor.group_alive(orphan)
        assert list(groups) == [serving.pgid]  # exactly one engine group: the recorded one
        assert serving.pid in groups[serving.pgid]
        assert Deployment.objects.get(pk=deployment.pk).state == "serving"

        # The start message redelivered late (visibility timeout, a duplicate): a no-op. A supervision
        # message sent just before beat stopped may still hold the lease ("busy"): wait it out.
        outcome = wait_until(
            lambda: (r := deployment_start(deployment.pk, owner="late-redelivery")) != "busy" and r,
            timeout_s=30,
            what="the lease free of supervision passes",
            interval_s=0.2,
        )
        assert outcome == "already serving"
        assert list(engine_groups(run_dir)) == [serving.pgid]
    finally:
        beat_stop.set()
        if agent.poll() is None:
            stop(agent)
        broker.delete(*[redis_keys().celery_key(name) for name in (queue, "unacked", "unacked_index")])
        broker.close()
