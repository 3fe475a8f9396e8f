"""`manage.py simulate --calibrate-from / --calibration` and the predict_sweep/calibrate_sweep contract."""

from __future__ import annotations

import json

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from inference.hardware import get_gpu
from inference.hf_config import resolve_model_config
from inference.loadgen.workloads import load_mix
from inference.profile import ProfileSettings
from inference.sim.costs import HostCosts
from inference.sim.engine import EngineConfig
from inference.sim.virtual import sweep
from portal.core.errors import ApplicationError
from portal.deployments.predict import calibrate_sweep, predict_sweep

H200_7B = [
    "--gpu", "h200-sxm-141gb", "--gpus", "1", "--model", "llama-2-7b-chat-hf", "--max-model-len", "4096"
]  # fmt: skip
MIX = "fixed:256:48"
# A slow host's constants (tests/sim/test_calibration.py): the "measured" report is the
# simulator's own sweep with them, written as `manage.py bench --json` writes it.
SLOW_HOST = {"step_overhead_s": 1.0e-3, "eager_launch_s_per_layer": 640e-6, "api_s_per_token": 15e-6}
PROFILE = dict(model="llama-2-7b-chat-hf", gpu="h200-sxm-141gb", gpus=1, mix=MIX, max_model_len=4096)


pytestmark = pytest.mark.django_db


@pytest.fixture(scope="module")
def bench_report(tmp_path_factory):
    profile = ProfileSettings(tensor_parallel_size=1, enforce_eager=True, max_model_len=4096)
    config = EngineConfig(
        model=resolve_model_config("llama-2-7b-chat-hf"),
        profile=profile,
        gpu=get_gpu("h200-sxm-141gb"),
        host=HostCosts.from_dict(SLOW_HOST),
    )
    measured = sweep(config, load_mix(MIX), [1, 4, 16], requests_per_level=48)
    report = {"model": "llama-2-7b", "mix": MIX, "levels": measured["levels"], "sla_concurrency": None}
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    path.write_text(json.dumps(report))
    return path


def simulate_json(capsys, *args: str) -> dict:
    call_command(
        "simulate", *H200_7B, "--mix", MIX, "--enforce-eager", "--requests-per-level", "48", "--json", *args
    )
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow  # out of make test-fast: a calibration fit, seconds of work on 2 cores
def test_it_fits_the_report_and_prints_the_calibration_beside_the_levels(capsys, bench_report):
    result = simulate_json(
        capsys, "--concurrency", "16", "--calibrate-from", str(bench_report), "--fit-levels", "1,4"
    )

    assert set(result) == {"levels", "sla_concurrency", "calibration"}
    assert set(result["calibration"]) == set(HostCosts().as_dict()) | {"basis"}
    # What it was fitted on travels with it (issue 40): the distance of a later question.
    assert result["calibration"]["basis"]["max_concurrency"] == 4
    assert result["calibration"]["basis"]["eager"] is True
    assert result["calibration"]["eager_launch_s_per_layer"] == pytest.approx(640e-6, rel=0.15)
    measured = json.loads(bench_report.read_text())["levels"][2]
    assert result["levels"][0]["output_throughput"] == pytest.approx(measured["output_throughput"], rel=0.05)


def test_it_applies_a_saved_calibration_without_fitting(capsys, bench_report, tmp_path):
    saved = tmp_path / "calibration.json"
    saved.write_text(json.dumps(SLOW_HOST))

    result = simulate_json(capsys, "--concurrency", "16", "--calibration", str(saved))

    assert result["calibration"] == HostCosts.from_dict(SLOW_HOST).as_dict()
    measured = json.loads(bench_report.read_text())["levels"][2]
    assert result["levels"][0]["output_throughput"] == pytest.approx(measured["output_throughput"], rel=1e-9)


@pytest.mark.slow  # out of make test-fast: a calibration fit, seconds of work on 2 cores
def test_it_prints_the_fit_beside_the_table(capsys, bench_report):
    call_command(
        "simulate", *H200_7B, "--mix", MIX, "--enforce-eager", "--concurrency", "4",
        "--requests-per-level", "16", "--calibrate-from", str(bench_report), "--fit-levels", "1",
    )  # fmt: skip
    out = capsys.readouterr().out
    assert "fitted on the measured levels" in out
    assert "host costs (fitted): step_overhead_s" in out
    assert "out tok/s" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--calibrate-from", "/nonexistent/bench.json"], r"^--calibrate-from: cannot read"),
        (["--calibration", "/nonexistent/calibration.json"], r"^--calibration: cannot read"),
        (["--fit-levels", "1"], r"^--fit-levels: give it with --calibrate-from"),
    ],
)
def test_it_names_the_flag_of_a_file_it_cannot_use(args, message):
    with pytest.raises(CommandError, match=message):
        call_command("simulate", *H200_7B, "--concurrency", "1", *args)


def test_it_names_the_calibration_flag_for_an_unknown_constant(tmp_path):
    saved = tmp_path / "calibration.json"
    saved.write_text(json.dumps({"launch_us": 600}))

    with pytest.raises(CommandError, match=r"^--calibration: unknown names launch_us"):
        call_command("simulate", *H200_7B, "--concurrency", "1", "--calibration", str(saved))


def test_it_names_the_report_flag_for_a_file_that_is_not_a_bench_report(tmp_path):
    report = tmp_path / "bench.json"
    report.write_text("[1, 2]")

    with pytest.raises(CommandError, match=r"^--calibrate-from: is not a report"):
        call_command("simulate", *H200_7B, "--concurrency", "1", "--calibrate-from", str(report))


def test_it_predicts_uncalibrated_with_the_defaults_and_says_so():
    result = predict_sweep(**PROFILE, concurrency=[1], requests_per_level=4)

    assert result["calibration"] == HostCosts().as_dict()


@pytest.mark.slow  # out of make test-fast: a calibration fit, seconds of work on 2 cores
def test_it_returns_the_fitted_calibration_and_the_fit_from_calibrate_sweep(bench_report):
    result = calibrate_sweep(
        measured=json.loads(bench_report.read_text()),
        fit_levels=[1, 4],
        **PROFILE,
        concurrency=[16],
        requests_per_level=48,
        enforce_eager=True,
    )

    assert result["calibration"]["eager_launch_s_per_layer"] == pytest.approx(640e-6, rel=0.15)
    assert [level["concurrency"] for level in result["levels"]] == [16]
    assert "sla_concurrency" in result
    assert [level["concurrency"] for level in result["fit"]["levels"]] == [1, 4]


def test_it_raises_an_application_error_naming_the_calibration():
    with pytest.raises(ApplicationError) as caught:
        predict_sweep(**PROFILE, concurrency=[1], calibration={"step_overhead_s": 5.0})

    assert caught.value.field == "calibration"


# --- a node's acceptance calibration (the record and its selector come with node acceptance) ---


@pytest.fixture
def accepted(monkeypatch, cpu_node):
    """`cpu_node` ("local") as if its latest acceptance had fitted SLOW_HOST."""
    from portal.inventory import selectors

    def latest(node):
        return dict(SLOW_HOST) if node.pk == cpu_node.pk else None

    monkeypatch.setattr(selectors, "node_latest_calibration", latest, raising=False)
    return cpu_node


def test_it_applies_the_nodes_acceptance_calibration(capsys, accepted, tmp_path):
    by_node = simulate_json(capsys, "--concurrency", "4", "--node", "local")
    saved = tmp_path / "calibration.json"
    saved.write_text(json.dumps(SLOW_HOST))
    by_file = simulate_json(capsys, "--concurrency", "4", "--calibration", str(saved))

    assert by_node["calibration"] == HostCosts.from_dict(SLOW_HOST).as_dict()
    assert by_node["levels"][0]["output_throughput"] == by_file["levels"][0]["output_throughput"]


def test_it_predicts_uncalibrated_for_a_node_without_an_acceptance(capsys, accepted, dgx):
    result = simulate_json(capsys, "--concurrency", "1", "--node", "dgx-v100-01")

    assert result["calibration"] == HostCosts().as_dict()


def test_it_names_the_node_flag_for_a_node_it_does_not_know(accepted):
    with pytest.raises(CommandError, match=r"^--node: no node is named 'nope'"):
        call_command("simulate", *H200_7B, "--concurrency", "1", "--node", "nope")


def test_it_predicts_on_the_planner_page_with_the_nodes_calibration(client, bob, accepted):
    client.force_login(bob)
    query = {
        "model": "llama-2-7b-chat-hf", "gpu": "h200-sxm-141gb", "gpus": 1, "dtype": "float16",
        "max_model_len": 4096, "gpu_memory_utilization": 0.9, "max_num_seqs": 256, "block_size": 16,
        "enforce_eager": "on", "mix": MIX, "concurrency": "1",
    }  # fmt: skip

    plain = client.get("/planner/predict/", query)
    calibrated = client.get("/planner/predict/", {**query, "node": "local"})

    assert "Uncalibrated host costs" in plain.content.decode()
    assert "calibrated on node local" in calibrated.content.decode()
    assert plain.context["result"]["calibration"] == HostCosts().as_dict()
    assert calibrated.context["result"]["calibration"] == HostCosts.from_dict(SLOW_HOST).as_dict()
    # A slow host's eager launches make one user's stream several times slower.
    slow, fast = (page.context["result"]["levels"][0]["output_throughput"] for page in (calibrated, plain))
    assert slow < fast / 2
