"""How sure the twin is (issue 40, item 3): ranges from the calibration's residuals and the question's
distance from it, the pessimistic end for the SLA cap, and no number where the twin cannot stand
behind one."""

from __future__ import annotations

import math

import pytest

from inference.errors import InputError
from inference.loadgen.sla import Sla
from inference.sim.confidence import CalibrationBasis, Question, judge, pessimistic_level
from portal.deployments.predict import predict_sweep

BASIS = CalibrationBasis(
    gpu="h200-sxm-141gb",
    eager=True,
    layers=32,
    mean_prompt_tokens=200,
    mean_output_tokens=128,
    max_concurrency=16,
    residuals={"output_throughput": 0.02, "mean_tpot_ms": 0.03, "mean_ttft_ms": 0.20},
)
SAME = Question(gpu="h200-sxm-141gb", eager=True, layers=32, mean_prompt_tokens=200, mean_output_tokens=128)
LEVEL = {
    "concurrency": 16,
    "output_throughput": 600.0,
    "mean_tpot_ms": 20.0,
    "p95_tpot_ms": 25.0,
    "mean_ttft_ms": 60.0,
    "p95_ttft_ms": 90.0,
}


def width(confidence, metric: str) -> float:
    interval = confidence.ranges[metric]
    return math.log(interval.high / interval.low)


def test_a_question_like_the_calibration_gets_its_residuals_and_the_hosts_spread():
    confidence = judge(LEVEL, basis=BASIS, calibrated=True, question=SAME)

    assert not confidence.outside
    ttft = confidence.ranges["mean_ttft_ms"]
    # The fit's own TTFT residual (0.20) plus the eager host's spread (0.10), each way.
    assert ttft.high == pytest.approx(60 * math.exp(0.30))
    assert ttft.low == pytest.approx(60 * math.exp(-0.30))
    # tok/s: the floor (0.05, above its residual) plus the host (0.25); its pessimistic end is the low one.
    assert confidence.ranges["output_throughput"].pessimistic == pytest.approx(600 * math.exp(-0.30))
    assert confidence.ranges["mean_tpot_ms"].pessimistic == confidence.ranges["mean_tpot_ms"].high


def test_the_range_widens_with_another_depth_another_workload_and_a_level_far_above():
    near = judge(LEVEL, basis=BASIS, calibrated=True, question=SAME)
    deeper = Question(**{**SAME.__dict__, "layers": 48})
    longer = Question(**{**SAME.__dict__, "mean_prompt_tokens": 1000})
    above = {**LEVEL, "concurrency": 128}

    for metric in ("output_throughput", "mean_tpot_ms", "mean_ttft_ms"):
        base = width(near, metric)
        assert width(judge(LEVEL, basis=BASIS, calibrated=True, question=deeper), metric) > base
        assert width(judge(LEVEL, basis=BASIS, calibrated=True, question=longer), metric) > base
        assert width(judge(above, basis=BASIS, calibrated=True, question=SAME), metric) > base
    notes = judge(above, basis=BASIS, calibrated=True, question=deeper).notes
    assert any("48 layers" in note for note in notes) and any("doublings" in note for note in notes)


@pytest.mark.parametrize(
    ("question", "concurrency", "says"),
    [
        (Question(**{**SAME.__dict__, "gpu": "v100-sxm2-32gb"}), 16, "a calibration is one node's"),
        (Question(**{**SAME.__dict__, "eager": False}), 16, "eager levels only"),
        (Question(**{**SAME.__dict__, "layers": 160}), 16, "over 4×"),
        (Question(**{**SAME.__dict__, "mean_prompt_tokens": 5000}), 16, "over 20×"),
        (SAME, 1024, "over 32× the highest calibrated level"),
    ],
)
def test_a_question_past_what_was_calibrated_gets_a_reason_instead_of_a_number(question, concurrency, says):
    confidence = judge({**LEVEL, "concurrency": concurrency}, basis=BASIS, calibrated=True, question=question)

    assert says in confidence.outside
    assert confidence.ranges == {}
    assert confidence.as_dict()["range"] is None


def test_uncalibrated_eager_on_a_fast_gpu_is_outside_and_on_a_v100_gets_wide_ranges():
    h200 = judge(LEVEL, basis=None, calibrated=False, question=SAME)
    v100 = judge(
        LEVEL, basis=None, calibrated=False, question=Question(**{**SAME.__dict__, "is_volta": True})
    )

    assert "calibrate the node" in h200.outside
    # Uncalibrated TTFT lacks the node's per-request work: its range reaches three times up.
    assert v100.ranges["mean_ttft_ms"].high / 60 > 3.0
    assert v100.ranges["mean_ttft_ms"].low / 60 > 0.8


def test_the_pessimistic_level_carries_why_it_is_outside_into_the_sla_choice():
    from inference.loadgen.sla import level_misses

    outside = judge({**LEVEL, "concurrency": 1024}, basis=BASIS, calibrated=True, question=SAME)
    worst = pessimistic_level({**LEVEL, "concurrency": 1024, "completed": 10}, outside)

    assert any(reason.startswith("no prediction:") for reason in level_misses(worst, Sla()))


def test_a_basis_that_is_not_readable_is_refused_naming_the_calibration():
    with pytest.raises(InputError, match="basis"):
        CalibrationBasis.from_dict({"gpu": "x", "eager": True, "layers": -3})
    assert CalibrationBasis.from_dict(BASIS.as_dict()) == BASIS


# --- through predict_sweep: the page's and the command's prediction ---

PROFILE = dict(
    model="llama-2-7b-chat-hf", gpu="v100-sxm2-32gb", gpus=1, mix="fixed:256:48", max_model_len=4096
)


@pytest.mark.django_db
def test_the_predicted_sla_point_is_chosen_on_the_pessimistic_end_of_each_range():
    levels = [1, 8]
    point = predict_sweep(**PROFILE, concurrency=levels, requests_per_level=16)
    p95_ttft = {level["concurrency"]: level["p95_ttft_ms"] for level in point["levels"]}
    # An SLA the predicted P95 TTFT of 8 users meets, and its pessimistic end (×3, uncalibrated) does not.
    limit_s = p95_ttft[8] * 1.5 / 1000

    result = predict_sweep(**PROFILE, concurrency=levels, requests_per_level=16, sla=Sla(p95_ttft_s=limit_s))

    judged = {level["concurrency"]: level["confidence"] for level in result["levels"]}
    assert judged[8]["range"]["p95_ttft_ms"][1] > limit_s * 1000
    assert result["sla_concurrency"] != 8
    assert "pessimistic end" in result["sla_reason"]


@pytest.mark.django_db
def test_a_calibration_saved_before_its_basis_still_predicts_with_wider_ranges():
    saved = {"step_overhead_s": 1.0e-3, "eager_launch_s_per_layer": 640e-6, "api_s_per_token": 15e-6}

    result = predict_sweep(
        **{**PROFILE, "gpu": "h200-sxm-141gb"}, concurrency=[4], requests_per_level=16, enforce_eager=True,
        calibration=saved,
    )  # fmt: skip

    confidence = result["levels"][0]["confidence"]
    assert not confidence["outside"]
    assert "does not say what it was fitted on" in confidence["notes"][0]
    assert "basis" not in result["calibration"]
