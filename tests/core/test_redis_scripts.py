"""The Lua scripts' one home: each compiles in the real Redis, each reads its keys and arguments
where its call record puts them, and Redis's clock is spelled once."""

from __future__ import annotations

import os
import re
from pathlib import Path

import redis

from portal.core.redis import scripts
from portal.core.redis.scripts import ScriptCall
from portal.gateway.admission import scripts as gateway_scripts
from portal.gateway.admission.scripts import (
    AcquireCall,
    AdmitCall,
    AdmitPlaceCall,
    CorrectionCall,
    FinishCall,
    QuotaCall,
    ReplicaCall,
)

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/15")
ROOT = Path(__file__).resolve().parents[2]
SOURCES = {
    name: getattr(gateway_scripts, name)
    for name in ("ADMIT", "ACQUIRE", "ADMIT_PLACE", "FINISH", "REBUILD_DAY", "GIVE_BACK", "RENEW")
} | {
    name: getattr(scripts, name)
    for name in ("USAGE_TAKE", "USAGE_GIVE_BACK", "USAGE_CLOSE_LAPSED", "USAGE_REPLAY", "MINUTE_MAX")
}


def positions(record: type[ScriptCall]) -> dict[str, int]:
    """The names a script's source declares for `record`, and their values."""
    names, values = record.lua_positions().removeprefix("local ").strip().split(" = ")
    return dict(zip(names.split(", "), map(int, values.split(", ")), strict=True))


def quota(scope: str) -> QuotaCall:
    return QuotaCall(f"{scope}-rpm", f"{scope}-tpm", f"{scope}-tpd:", f"{scope}-conc", 1, 2, 3, 4)


def test_every_script_compiles_in_redis():
    client = redis.Redis.from_url(REDIS_URL)
    try:
        for name, source in SOURCES.items():
            assert re.fullmatch(r"[0-9a-f]{40}", client.script_load(source)), name
    finally:
        client.close()


def test_admission_and_placement_read_their_arguments_where_the_records_put_them():
    admit = AdmitCall(
        blocked_team="bt", blocked_key="bk", request_id="req", tokens=10, lease_ms=30_000,
        team=quota("team"), api_key=quota("key"), reservation="resv", report_missing_day=1,
    )  # fmt: skip
    acquire = AcquireCall(
        queue="q", interactive_queue="iq", request_id="req", lease_ms=30_000, is_long=0, long_cap=2,
        queue_max=256, queue_stale_ms=40_000, slots=1, is_batch=0, interactive_queue_stale_ms=40_000,
        candidates=[ReplicaCall("in1", "long1", 4), ReplicaCall("in2", "long2", -1)],
    )  # fmt: skip
    call = AdmitPlaceCall(
        admit=admit, usage_open="open", usage_open_leases="open-leases", open_record="{}", acquire=acquire
    )
    keys, args = call.keys(), call.args()
    at = positions(AdmitCall) | positions(QuotaCall) | positions(AcquireCall) | positions(AdmitPlaceCall)
    at |= positions(ReplicaCall)

    assert keys[at["ADMIT_K_RESERVATION"] - 1] == "resv"
    assert args[at["ADMIT_A_REPORT_MISSING_DAY"] - 1] == 1
    # The key's quotas follow the team's, one quota record's width apart.
    key_scope = at["ADMIT_K_TEAM"] - 1 + at["QUOTA_K_WIDTH"]
    assert keys[key_scope + at["QUOTA_K_CONCURRENCY"] - 1] == "key-conc"
    assert args[at["ADMIT_A_TEAM"] - 1 + at["QUOTA_A_WIDTH"] + at["QUOTA_A_MAX_CONCURRENT"] - 1] == 4
    # Placement reads its own after the admission's: the second candidate's keys and cap.
    k0, a0 = at["ADMIT_PLACE_K_ACQUIRE"] - 1, at["ADMIT_PLACE_A_ACQUIRE"] - 1
    assert keys[k0 + at["ACQUIRE_K_QUEUE"] - 1] == "q"
    assert args[a0 + at["ACQUIRE_A_SLOTS"] - 1] == 1
    second_k = k0 + at["ACQUIRE_K_CANDIDATES"] - 1 + at["REPLICA_K_WIDTH"]
    second_a = a0 + at["ACQUIRE_A_CANDIDATES"] - 1 + at["REPLICA_A_WIDTH"]
    assert keys[second_k + at["REPLICA_K_LONG"] - 1] == "long2"
    assert args[second_a + at["REPLICA_A_CAP"] - 1] == -1
    assert len(keys) == second_k + at["REPLICA_K_WIDTH"] and len(args) == second_a + at["REPLICA_A_WIDTH"]


def test_finish_finds_its_corrections_after_a_variable_number_of_slots():
    call = FinishCall(
        usage_list="usage", request_id="req", usage_json="{}", n_slots=3, delta_tokens=-5, members=1,
        admitted_us=1, reserved_tokens=20, usage_open="open", usage_open_leases="open-leases", close_open=1,
        slots=["s1", "s2", "s3"],
        corrections=[CorrectionCall("tpm-t", "tpd-t", "rb-t", 60), CorrectionCall("tpm-k", "", "", 0)],
    )  # fmt: skip
    keys, args = call.keys(), call.args()
    at = positions(FinishCall) | positions(CorrectionCall)
    assert keys[at["FINISH_K_SLOTS"] - 1 : at["FINISH_K_SLOTS"] - 1 + call.n_slots] == ["s1", "s2", "s3"]
    first = at["FINISH_K_SLOTS"] - 1 + call.n_slots  # as the script counts its way there
    assert keys[first + at["CORRECTION_K_WIDTH"] + at["CORRECTION_K_TPM_TAT"] - 1] == "tpm-k"
    assert args[at["FINISH_A_CORRECTIONS"] - 1 + at["CORRECTION_A_TPM"] - 1] == 60


def test_redis_time_is_spelled_once_in_the_tree():
    spelled = [
        path.relative_to(ROOT).as_posix()
        for top in ("portal", "inference")
        for path in (ROOT / top).rglob("*.py")
        if "redis.call('TIME')" in path.read_text()
    ]
    assert spelled == ["portal/core/redis/scripts.py"]
    assert gateway_scripts.ADMIT_PLACE.count("redis.call('TIME')") == 1


def test_inference_does_not_touch_redis():
    # The engine side has no Redis: the portal's Redis infrastructure lives in portal/core/redis.
    users = [
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "inference").rglob("*.py")
        if re.search(r"^\s*(import redis|from redis\b)", path.read_text(), re.M)
    ]
    assert users == []
