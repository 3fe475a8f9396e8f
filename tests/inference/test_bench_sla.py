"""Picking the SLA operating point."""

from inference.loadgen.sla import Sla, operating_point

# The 7B/TP8 table of docs/v100-field-guide.md#reference-run, in vLLM's key names (ms).
FIELD_TABLE = [
    {"concurrency": c, "failed": 0, "p95_ttft_ms": ttft * 1000, "p95_tpot_ms": tpot * 1000}
    for c, ttft, tpot in (
        (16, 0.82, 0.065),
        (32, 1.35, 0.088),
        (64, 2.10, 0.120),
        (128, 3.20, 0.175),
        (256, 6.50, 0.310),
    )
]


def test_it_picks_64_on_the_field_table_and_says_why_128_misses():
    level, why = operating_point(FIELD_TABLE, Sla())
    assert level == 64
    assert "128 misses: P95 TTFT 3.20 s > 3 s" in why


def test_it_uses_a_looser_sla():
    level, _ = operating_point(FIELD_TABLE, Sla(p95_ttft_s=4.0, p95_tpot_s=0.2))
    assert level == 128


def test_it_refuses_a_level_with_failed_requests():
    levels = [dict(FIELD_TABLE[0]), dict(FIELD_TABLE[1], failed=2)]
    level, why = operating_point(levels, Sla())
    assert level == 16
    assert "32 misses: 2 failed request(s)" in why


def test_it_says_when_no_level_meets_the_sla():
    level, why = operating_point(FIELD_TABLE, Sla(p95_ttft_s=0.5))
    assert level is None
    assert "no level meets the SLA" in why and "16 misses" in why


def test_it_says_when_every_level_passed():
    level, why = operating_point(FIELD_TABLE[:2], Sla())
    assert level == 32
    assert "higher levels were not measured" in why


def test_it_does_not_count_a_missing_measurement_as_a_pass():
    level, why = operating_point(
        [{"concurrency": 8, "failed": 0, "p95_ttft_ms": 10.0, "p95_tpot_ms": None}], Sla()
    )
    assert level is None
    assert "no P95 TPOT measured" in why


def test_it_does_not_trust_a_client_bound_level():
    levels = [
        dict(FIELD_TABLE[0]),
        dict(FIELD_TABLE[1], client_bound=True, client_bound_reason="event-loop lag P95 14.0 ms"),
    ]
    level, why = operating_point(levels, Sla())
    assert level == 16
    assert "32 misses: client-bound (event-loop lag P95 14.0 ms)" in why
