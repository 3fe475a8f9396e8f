"""The SSE pass-through on its own: bytes unchanged, usage read, the usage-only chunk stripped on request."""

from __future__ import annotations

from portal.gateway.sse import SseRelay

CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}\n\n'
DONE = b"data: [DONE]\n\n"


def relay_all(relay: SseRelay, pieces: list[bytes]) -> bytes:
    return b"".join(relay.feed(p) for p in pieces) + relay.tail()


def test_it_passes_whole_events_through_unchanged():
    relay = SseRelay(strip_usage=False)
    assert relay.feed(CHUNK) is CHUNK


def test_it_reads_usage_and_keeps_it_when_asked():
    relay = SseRelay(strip_usage=False)
    assert relay_all(relay, [CHUNK, CHUNK, USAGE, DONE]) == CHUNK + CHUNK + USAGE + DONE
    assert relay.usage == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def test_it_strips_the_usage_chunk_when_the_client_did_not_ask():
    relay = SseRelay(strip_usage=True)
    assert relay_all(relay, [CHUNK, USAGE, DONE]) == CHUNK + DONE
    assert relay.usage["completion_tokens"] == 2


def test_it_reassembles_events_split_across_chunks_byte_for_byte():
    stream = CHUNK + CHUNK + USAGE + DONE
    for size in (1, 7, 50):
        relay = SseRelay(strip_usage=False)
        pieces = [stream[i : i + size] for i in range(0, len(stream), size)]
        assert relay_all(relay, pieces) == stream
        assert relay.usage["prompt_tokens"] == 3


def test_it_estimates_completion_tokens_without_a_usage_chunk():
    relay = SseRelay(strip_usage=False)
    relay_all(relay, [CHUNK, CHUNK, CHUNK, DONE])
    assert relay.estimated_completion_tokens() == 3


def test_it_keeps_usage_on_a_chunk_that_also_has_choices():
    both = (
        b'data: {"choices":[{"index":0,"delta":{"content":"b"}}],'
        b'"usage":{"prompt_tokens":1,"completion_tokens":1}}\n\n'
    )
    relay = SseRelay(strip_usage=True)
    assert relay_all(relay, [both]) == both


def test_it_counts_the_tokens_of_a_stream_cut_before_its_end():
    # vLLM's chat stream opens with a role-only event; a dead upstream sends no usage and no [DONE].
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    relay = SseRelay(strip_usage=False)
    relay_all(relay, [role, CHUNK, CHUNK + CHUNK])
    assert relay.estimated_completion_tokens() == 3
    completion = SseRelay(strip_usage=False)
    relay_all(completion, [CHUNK, CHUNK])
    assert completion.estimated_completion_tokens() == 2
