"""The in-engine timer of issue 40's GPU runs (scripts/step_timer) and the probe's reading of it.

vLLM is not imported here: a stand-in package with the same module and method names plays the
engine, in a real Python process started the way the probe starts vLLM (the timer's folder first on
PYTHONPATH), so what is proved is the import hook, the wrapping and the file it writes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMER = ROOT / "scripts" / "step_timer"

SCHEDULER = """
class Output:
    def __init__(self, tokens):
        self.num_scheduled_tokens = tokens
        self.total_num_scheduled_tokens = sum(tokens.values())


class Scheduler:
    def schedule(self, throttle=False):
        return Output({"a": 1, "b": 1, "c": 5})

    def update_from_output(self, scheduler_output, model_output):
        return {}
"""
RUN = """
from vllm.v1.core.sched.scheduler import Scheduler
scheduler = Scheduler()
for _ in range(3):
    scheduler.update_from_output(scheduler.schedule(), None)
"""


def run_engine_stand_in(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    package = tmp_path / "site" / "vllm" / "v1" / "core" / "sched"
    package.mkdir(parents=True)
    for folder in (package, *package.parents):
        if folder == tmp_path / "site":
            break
        (folder / "__init__.py").touch()
    (package / "scheduler.py").write_text(SCHEDULER)
    path = os.pathsep.join([str(TIMER), str(tmp_path / "site")])
    return subprocess.run(
        [sys.executable, "-c", RUN],
        env={**os.environ, "PYTHONPATH": path, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )


def test_it_times_every_call_with_the_sizes_of_the_step(tmp_path):
    out = tmp_path / "steps"

    run_engine_stand_in(tmp_path, STEP_TIMER_DIR=str(out))

    [log] = list(out.glob("*.tsv"))
    rows = [line.split("\t") for line in log.read_text().splitlines()]
    assert [row[0] for row in rows] == ["schedule", "update_from_output"] * 3
    # schedule(): the sizes of the output it returns; update_from_output: of the output it was given.
    assert {(row[3], row[4]) for row in rows} == {("3", "7")}
    assert all(float(row[2]) >= 0 for row in rows)


def test_without_its_variable_nothing_is_patched_or_written(tmp_path):
    done = run_engine_stand_in(tmp_path)

    assert not (tmp_path / "steps").exists() and not done.stderr


@pytest.fixture()
def probe():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_host_probe

        yield gpu_host_probe
    finally:
        sys.path.remove(str(ROOT / "scripts"))


def test_the_probe_splits_a_decode_step_into_its_parts(probe):
    # (part, start, duration, requests, tokens, pid): two decode steps of 4 sequences, one prefill.
    rows = [
        ("schedule", 1.000, 0.001, 4, 4, 1),
        ("execute_model", 1.001, 0.010, 4, 4, 1),
        ("forward", 1.002, 0.008, 0, 0, 1),
        ("sample_tokens", 1.011, 0.001, 0, 0, 1),
        ("schedule", 1.020, 0.001, 4, 4, 1),
        ("execute_model", 1.021, 0.012, 4, 4, 1),
        ("forward", 1.022, 0.010, 0, 0, 1),
        ("schedule", 1.040, 0.001, 4, 900, 1),
        ("execute_model", 1.041, 0.050, 4, 900, 1),
        ("process_outputs", 1.045, 0.0002, 4, 0, 2),
    ]

    parts = probe.step_parts(rows)

    assert parts["decode_steps"] == 2 and parts["prefill_steps"] == 1
    assert parts["forward"] == pytest.approx(9.0) and parts["prepare"] == pytest.approx(2.0)
    assert parts["period"] == pytest.approx(20.0) and parts["mean_decode_batch"] == 4
    assert parts["process_outputs_per_output_us"] == pytest.approx(50.0)


def test_the_probe_lists_each_prefill_step_with_its_period(probe):
    rows = [
        ("schedule", 1.000, 0.001, 4, 4, 1),
        ("execute_model", 1.001, 0.010, 4, 4, 1),
        ("schedule", 1.020, 0.001, 4, 900, 1),
        ("execute_model", 1.021, 0.030, 4, 900, 1),
        ("sample_tokens", 1.052, 0.040, 0, 0, 1),
        ("schedule", 1.095, 0.001, 4, 4, 1),
    ]

    (step,) = probe.prefill_steps(rows)

    assert step[:2] == [4, 900]
    assert step[2:] == [pytest.approx(75.0), pytest.approx(30.0), pytest.approx(40.0)]
