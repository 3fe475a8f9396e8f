"""When to restart a server (inference/restart_policy.py): plain decisions on the facts given."""

import pytest

from inference.restart_policy import (
    RestartPolicy,
    crash_restart,
    pending_rescue_s,
    planned_restart_reason,
    preemptions_since_start,
    restart_backoff_s,
)


@pytest.mark.parametrize(
    ("policy", "facts", "expected"),
    [
        (RestartPolicy(), {"uptime_s": 1e9}, ""),
        (
            RestartPolicy(max_uptime_hours=48),
            {"uptime_s": 49 * 3600},
            "up 49.0 h (policy: restart after 48 h)",
        ),
        (RestartPolicy(max_uptime_hours=48), {"uptime_s": 47 * 3600}, ""),
        (RestartPolicy(max_preemptions=100), {"preemptions_since_start": 150}, "150 preemptions since start"),
        (
            RestartPolicy(max_memory_growth=0.2),
            {"memory_mb": 1300, "baseline_memory_mb": 1000},
            "memory grew 30%",
        ),
        (RestartPolicy(max_memory_growth=0.2), {"memory_mb": 1100, "baseline_memory_mb": 1000}, ""),
    ],
)
def test_it_plans_restarts_by_uptime_preemptions_and_memory_creep(policy, facts, expected):
    args = {
        "uptime_s": 0,
        "preemptions_since_start": None,
        "memory_mb": None,
        "baseline_memory_mb": None,
        **facts,
    }
    reason = planned_restart_reason(policy, **args)
    assert reason.startswith(expected) if expected else reason == ""


def test_it_backs_off_exponentially_up_to_a_cap():
    assert [restart_backoff_s(n, base_s=10) for n in (1, 2, 3, 4)] == [10, 20, 40, 80]
    assert restart_backoff_s(20, base_s=10, cap_s=600) == 600


def test_after_a_crash_it_restarts_with_a_backoff_until_the_limit():
    first = crash_restart(0, limit=3, base_s=10)
    assert (first.attempt, first.limit, first.delay_s) == (1, 3, 10)
    assert crash_restart(2, limit=3, base_s=10).delay_s == 40
    past = crash_restart(3, limit=3, base_s=10)
    assert (past.attempt, past.delay_s) == (4, None)  # restarted 3 times in a row: no more


def test_a_pending_start_is_rescued_only_after_the_longest_backoff():
    assert pending_rescue_s(limit=3, base_s=10) == 40 + 120
    assert pending_rescue_s(limit=3, base_s=10) > crash_restart(2, limit=3, base_s=10).delay_s


def test_preemptions_are_counted_from_the_baseline_when_both_are_known():
    assert preemptions_since_start(150, 40) == 110
    assert preemptions_since_start(None, 40) is None
    assert preemptions_since_start(150, None) is None
