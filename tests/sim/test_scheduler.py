"""The simulated scheduler and KV cache follow vLLM's V1 rules."""

from __future__ import annotations

from inference.sim.kv_cache import KVCache
from inference.sim.scheduler import Scheduler, SimRequest, Status


def scheduler(
    *, blocks=64, block_size=16, max_num_seqs=8, budget=256, chunked=True, prefix=False, max_len=4096
):
    kv = KVCache(blocks, block_size, enable_prefix_caching=prefix)
    return Scheduler(
        kv_cache=kv,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_len,
        enable_chunked_prefill=chunked,
    )


def request(name: str, prompt: int, output: int, *, first_token: int = 0) -> SimRequest:
    ids = list(range(first_token, first_token + prompt))
    return SimRequest(request_id=name, prompt_token_ids=ids, max_tokens=output)


def run_step(s: Scheduler):
    plan = s.schedule()
    return plan, s.finish_step(plan)


def test_it_admits_a_request_only_when_its_prompt_blocks_are_free():
    s = scheduler(blocks=4, block_size=16)
    big = request("big", 40, 5)  # 3 blocks
    other = request("other", 30, 5, first_token=1000)  # 2 blocks: only 1 left
    s.add(big)
    s.add(other)
    plan, _ = run_step(s)
    assert [r.request_id for r, _ in plan.scheduled] == ["big"]
    assert other.status is Status.WAITING
    assert s.kv.num_free_blocks == 1


def test_it_stops_admitting_at_max_num_seqs():
    s = scheduler(max_num_seqs=2)
    for i in range(3):
        s.add(request(f"r{i}", 10, 5, first_token=i * 100))
    plan, _ = run_step(s)
    assert len(plan.scheduled) == 2
    assert len(s.waiting) == 1


def test_it_preempts_the_newest_running_request_when_the_cache_fills():
    s = scheduler(blocks=4, block_size=4, budget=64)
    first = request("first", 7, 20)  # 2 blocks
    second = request("second", 7, 20, first_token=100)  # 2 blocks: cache full
    s.add(first)
    s.add(second)
    run_step(s)
    assert s.kv.num_free_blocks == 0
    # Both now hold 8 tokens' worth of slots; the next token of `first` needs a third block.
    run_step(s)
    plan, _ = run_step(s)
    assert second in plan.preempted
    assert second.status is Status.WAITING and second.num_computed_tokens == 0
    assert s.waiting[0] is second
    assert s.num_preemptions >= 1
    assert first.status is Status.RUNNING


def test_it_recomputes_a_preempted_request_and_still_finishes_it():
    s = scheduler(blocks=6, block_size=4, budget=64)
    requests = [request(f"r{i}", 7, 12, first_token=i * 100) for i in range(3)]
    for r in requests:
        s.add(r)
    for _ in range(200):
        if not s.has_work:
            break
        run_step(s)
    assert all(r.status is Status.FINISHED and r.num_output_tokens == 12 for r in requests)
    assert s.num_preemptions > 0
    assert s.kv.num_free_blocks == 6


def test_it_reuses_cached_prefix_blocks_of_an_earlier_prompt():
    s = scheduler(prefix=True, block_size=16)
    first = request("first", 100, 2)
    s.add(first)
    while s.has_work:
        run_step(s)
    second = SimRequest(request_id="second", prompt_token_ids=list(range(64)) + [9999] * 36, max_tokens=2)
    s.add(second)
    plan, _ = run_step(s)
    assert second.num_cached_tokens == 64
    assert plan.scheduled == [(second, 36)]
    assert s.kv.prefix_hits == 64


def test_it_computes_the_last_token_even_when_the_whole_prompt_is_cached():
    s = scheduler(prefix=True, block_size=16)
    first = request("first", 64, 1)
    s.add(first)
    while s.has_work:
        run_step(s)
    again = request("again", 64, 1)
    s.add(again)
    plan, _ = run_step(s)
    assert again.num_cached_tokens == 48
    assert plan.scheduled == [(again, 16)]


def test_it_does_not_share_blocks_without_prefix_caching():
    s = scheduler(prefix=False)
    s.add(request("first", 64, 1))
    while s.has_work:
        run_step(s)
    again = request("again", 64, 1)
    s.add(again)
    plan, _ = run_step(s)
    assert plan.scheduled == [(again, 64)]


def test_it_cuts_a_long_prompt_into_chunks_with_chunked_prefill():
    s = scheduler(budget=100, chunked=True)
    long = request("long", 250, 3)
    s.add(long)
    chunks = []
    while long.num_output_tokens == 0:
        plan, _ = run_step(s)
        chunks.append(plan.scheduled[0][1])
    assert chunks == [100, 100, 50]


def test_it_runs_decodes_first_and_gives_the_rest_of_the_budget_to_a_prompt():
    s = scheduler(budget=100, chunked=True)
    short = request("short", 10, 50)
    s.add(short)
    run_step(s)
    long = request("long", 500, 3, first_token=1000)
    s.add(long)
    plan, _ = run_step(s)
    assert plan.scheduled == [(short, 1), (long, 99)]


def test_it_holds_a_prompt_over_the_budget_without_chunked_prefill():
    s = scheduler(budget=100, chunked=False)
    short = request("short", 10, 50)
    s.add(short)
    run_step(s)
    long = request("long", 150, 3, first_token=1000)
    s.add(long)
    plan, _ = run_step(s)
    assert plan.scheduled == [(short, 1)]
    assert long.status is Status.WAITING


def test_it_finishes_at_max_tokens_with_reason_length_and_frees_the_blocks():
    s = scheduler()
    r = request("r", 20, 3)
    s.add(r)
    outputs = 0
    while s.has_work:
        _, outcome = run_step(s)
        outputs += len(outcome.sampled)
    assert outputs == 3
    assert r.finish_reason == "length"
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_it_stops_early_when_the_model_emits_eos():
    s = scheduler()
    r = SimRequest(request_id="r", prompt_token_ids=list(range(20)), max_tokens=50, stop_after=4)
    s.add(r)
    while s.has_work:
        run_step(s)
    assert (r.num_output_tokens, r.finish_reason) == (4, "stop")


def test_it_frees_the_blocks_of_an_aborted_request():
    s = scheduler()
    r = request("r", 40, 50)
    s.add(r)
    run_step(s)
    s.abort(r)
    assert r.status is Status.ABORTED
    assert s.kv.num_free_blocks == s.kv.num_blocks
    assert not s.has_work
