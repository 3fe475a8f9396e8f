"""inference.rollout without Django: steps checked, the verdict on one step's windows."""

from __future__ import annotations

import dataclasses

import pytest

from inference.errors import InputError
from inference.rollout import (
    Decision,
    Evaluation,
    Policy,
    Rule,
    Step,
    Window,
    judge,
    parse_steps,
    split_share,
)

POLICY = Policy(
    sla_p95_ttft_ms=3000,
    sla_p95_tpot_ms=100,
    min_requests=20,
    max_error_rate_increase=0.01,
    max_latency_ratio=1.5,
)
STEP = Step(25, 10)
GOOD_OLD = Window(requests=300, errors=0, p95_ttft_ms=500, p95_tpot_ms=40)


def test_it_reads_steps_in_either_form_and_checks_them():
    assert parse_steps([[5, 10], {"share_percent": 100, "minutes": 1}]) == (Step(5, 10), Step(100, 1))
    for bad, message in [
        ([], "1 to 20 steps"),
        ([[5, 10]] * 21, "1 to 20 steps"),
        ([[0, 10], [100, 1]], "1 to 100 %"),
        ([[True, 10], [100, 1]], "whole numbers"),
        ([[5.5, 10], [100, 1]], "whole numbers"),
        ([[5, 10, 1]], "(share %, minutes)"),
        ("5,100", "1 to 20 steps"),
    ]:
        with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
            parse_steps(bad)


def test_a_quiet_good_step_holds_until_its_minutes_and_its_requests():
    new = Window(requests=25, errors=0, p95_ttft_ms=520, p95_tpot_ms=41)
    assert judge(new=new, old=GOOD_OLD, policy=POLICY, step=STEP, elapsed_s=599).decision == Decision.HOLD
    assert judge(new=new, old=GOOD_OLD, policy=POLICY, step=STEP, elapsed_s=600).decision == Decision.ADVANCE
    few = Window(requests=19, p95_ttft_ms=520, p95_tpot_ms=41)
    assert judge(new=few, old=GOOD_OLD, policy=POLICY, step=STEP, elapsed_s=6000).decision == Decision.HOLD


def test_an_sla_miss_rolls_back_however_few_the_requests():
    new = Window(requests=1, p95_ttft_ms=20, p95_tpot_ms=150)
    verdict = judge(new=new, old=GOOD_OLD, policy=POLICY, step=STEP, elapsed_s=1)
    assert verdict.decision == Decision.ROLL_BACK
    assert verdict.reasons == ("P95 TPOT 150.0 ms > SLA 100.0 ms",)


def test_rates_and_ratios_need_evidence_on_both_sides():
    new = Window(requests=25, errors=2, p95_ttft_ms=900, p95_tpot_ms=40)
    assert judge(new=new, old=GOOD_OLD, policy=POLICY, step=STEP, elapsed_s=1).decision == Decision.ROLL_BACK
    quiet_old = Window(requests=5, errors=0, p95_ttft_ms=100, p95_tpot_ms=10)
    no_errors = Window(requests=25, errors=0, p95_ttft_ms=900, p95_tpot_ms=40)
    assert (
        judge(new=no_errors, old=quiet_old, policy=POLICY, step=STEP, elapsed_s=1).decision == Decision.HOLD
    )


def test_a_share_splits_the_pairs_total():
    assert split_share(10_000, 5) == (500, 9_500)
    assert split_share(6_000, 25) == (1_500, 4_500)  # another version keeps its 40 %
    assert split_share(10_000, 100) == (10_000, 0)


def test_a_step_may_last_seconds_for_tests_and_benchmarks():
    steps = parse_steps([{"share_percent": 50, "seconds": 20}, [100, 1]])
    assert steps == (Step(50, seconds=20), Step(100, 1))
    assert [s.duration_s for s in steps] == [20, 60]
    assert [s.as_dict() for s in steps] == [
        {"share_percent": 50, "seconds": 20},
        {"share_percent": 100, "minutes": 1},
    ]
    with pytest.raises(InputError, match="5 to 86400 seconds"):
        parse_steps([{"share_percent": 100, "seconds": 2}])
    policy = Policy(1000, 100, min_requests=5, max_error_rate_increase=0.01, max_latency_ratio=1.5)
    good = Window(requests=5, p95_ttft_ms=100, p95_tpot_ms=10)
    held = judge(new=good, old=Window(), policy=policy, step=steps[0], elapsed_s=19)
    assert held.decision == Decision.HOLD
    assert (
        judge(new=good, old=Window(), policy=policy, step=steps[0], elapsed_s=20).decision == Decision.ADVANCE
    )


def test_it_ignores_a_ratio_that_is_tens_of_ms_against_a_seconds_sla():
    new = Window(requests=80, p95_ttft_ms=103.9, p95_tpot_ms=41)
    old = Window(requests=300, p95_ttft_ms=60.0, p95_tpot_ms=40)
    verdict = judge(new=new, old=old, policy=POLICY, step=STEP, elapsed_s=600)
    assert verdict.decision == Decision.ADVANCE
    assert verdict.rule == Rule.STEP_PASSED


def test_it_rolls_back_slower_than_the_old_version_beyond_both_the_ratio_and_the_margin():
    new = Window(requests=80, p95_ttft_ms=900, p95_tpot_ms=40)
    verdict = judge(new=new, old=GOOD_OLD, policy=POLICY, step=STEP, elapsed_s=1)
    assert verdict.decision == Decision.ROLL_BACK
    assert verdict.rule == Rule.SLOWER_THAN_OLD
    assert verdict.reasons == (
        "P95 TTFT 900.0 ms > 1.5 × old version's 500.0 ms and 400.0 ms over it > margin 300 ms",
    )


def test_an_error_rate_over_the_ceiling_rolls_back_whatever_the_old_version_does():
    new = Window(requests=40, errors=2, p95_ttft_ms=500, p95_tpot_ms=40)  # within a point of the old one
    old = Window(requests=300, errors=13, p95_ttft_ms=500, p95_tpot_ms=40)  # 4.3 %: under the ceiling
    verdict = judge(new=new, old=old, policy=POLICY, step=STEP, elapsed_s=600)
    assert verdict.decision == Decision.ROLL_BACK
    assert verdict.rule == Rule.ERROR_CEILING
    assert verdict.reasons == ("error rate 5.0% (2/40) ≥ ceiling 5.0%",)


def test_both_versions_failing_is_an_outage_that_pauses_not_a_verdict():
    new = Window(requests=38, errors=38)
    old = Window(requests=146, errors=146)
    verdict = judge(new=new, old=old, policy=POLICY, step=STEP, elapsed_s=600)
    assert verdict.decision == Decision.PAUSE
    assert verdict.rule == Rule.OUTAGE
    assert "outage: both versions fail" in verdict.reasons[0]


def test_an_error_increase_needs_enough_requests_on_the_old_side_too():
    new = Window(requests=40, errors=1, p95_ttft_ms=500, p95_tpot_ms=40)  # 2.5 %: under the ceiling
    quiet_old = Window(requests=5, errors=0, p95_ttft_ms=500, p95_tpot_ms=40)
    verdict = judge(new=new, old=quiet_old, policy=POLICY, step=STEP, elapsed_s=600)
    assert verdict.decision == Decision.ADVANCE


def test_sla_only_leaves_the_old_version_out_of_the_judgement():
    sla_only = dataclasses.replace(POLICY, compare_sla_only=True)
    new = Window(requests=40, errors=0, p95_ttft_ms=2500, p95_tpot_ms=90)  # 5× slower, within the SLA
    verdict = judge(new=new, old=GOOD_OLD, policy=sla_only, step=STEP, elapsed_s=600)
    assert verdict.decision == Decision.ADVANCE


def test_an_evaluation_reads_back_from_its_stored_form_as_a_sentence():
    verdict = judge(new=Window(requests=38, errors=38), old=Window(requests=146, errors=146),
                    policy=POLICY, step=STEP, elapsed_s=30)  # fmt: skip
    evaluation = Evaluation(
        step=0, elapsed_s=30, new=Window(requests=38, errors=38), old=Window(requests=146, errors=146),
        decision=verdict.decision, rule=verdict.rule, reasons=verdict.reasons,
        sla_p95_ttft_ms=3000, sla_p95_tpot_ms=100,
    )  # fmt: skip
    stored = Evaluation.from_dict(evaluation.as_dict())
    assert stored == evaluation
    text = stored.describe()
    assert text.startswith("Step 1 after 30 s: pause — both versions failing pauses the rollout")
    assert "New: 38 requests, 38 errors (100.0%)" in text and "{" not in text
    assert Evaluation.from_dict({"step": 0, "new": {}, "old": {}}) is None
