"""A batch's lines go through the gateway's admission in the batch class, whatever its key's class:
never more in flight on a replica than the batch share of its cap (GATEWAY_BATCH_SHARE, 0.5),
however many lines the runner may send at once."""

from __future__ import annotations

import httpx
import pytest

from devtools import stop, wait_until
from tests.helpers.batches import (
    assert_each_line_once,
    create_batch,
    empty_batch_queue,
    input_lines,
    start_batch_worker,
    usage_of,
)
from tests.helpers.gateway import make_setup, spawn_fake_upstream

pytestmark = [pytest.mark.django_db(transaction=True)]


@pytest.mark.timeout(240)
def test_an_interactive_keys_batch_never_takes_more_than_the_batch_share_of_a_replica(
    gw_redis, team, cpu_node, tmp_path
):
    upstream, fake = spawn_fake_upstream(100)  # 8 chunks: 0.8 s a line
    empty_batch_queue()
    worker = start_batch_worker(tmp_path / "worker.log", BATCH_CONCURRENCY="16")
    try:
        setup = make_setup(team=team, node=cpu_node, upstream=upstream, cap=4)
        assert setup.key.effective_priority_class() == "interactive"
        batch = create_batch(setup.team, setup.key, input_lines(12, model=setup.model, max_tokens=8))

        def ended():
            batch.refresh_from_db()
            return batch.status in {"completed", "failed", "expired", "cancelled"}

        wait_until(
            ended,
            timeout_s=180,
            interval_s=0.5,
            what=f"ended\n{(tmp_path / 'worker.log').read_text()[-3000:]}",
        )
        stats = httpx.get(f"{upstream}/stats").json()
    finally:
        stop(worker)
        stop(fake)
    assert batch.status == "completed" and batch.request_completed == 12
    assert stats["started"] == 12
    assert stats["max_in_flight"] == 2  # half of the cap of 4: the batch share, not the runner's 16
    assert_each_line_once(batch)
    assert set(usage_of(batch.public_id).values_list("priority_class", flat=True)) == {"batch"}
