"""Workload mixes: presets, fixed lengths, mix files, seeded sampling, bad shares."""

import json

import pytest

from inference.errors import InputError
from inference.loadgen.workloads import PRESETS, Bucket, Mix, RequestSpec, load_mix


def test_it_has_the_named_presets():
    assert set(PRESETS) == {"field-mix", "short-qa", "long-summary", "qa-summary-60-40", "prefix-shared"}


def test_it_samples_the_same_requests_for_the_same_seed():
    mix = load_mix("field-mix")
    assert mix.sample(50, seed=7) == mix.sample(50, seed=7)
    assert mix.sample(50, seed=7) != mix.sample(50, seed=8)


def test_it_gives_each_bucket_its_exact_share():
    specs = load_mix("field-mix").sample(100, seed=1)
    counts = [
        sum(1 for s in specs if low <= s.prompt_tokens <= high)
        for low, high in ((50, 499), (500, 1499), (1500, 2999), (3000, 4000))
    ]
    assert counts == [40, 30, 20, 10]
    assert all(200 <= s.output_tokens <= 500 for s in specs)


def test_it_splits_qa_and_summary_60_40():
    specs = load_mix("qa-summary-60-40").sample(10, seed=0)
    short = [s for s in specs if s.prompt_tokens <= 300]
    assert len(short) == 6
    assert all(500 <= s.output_tokens <= 800 for s in specs if s not in short)


def test_it_shares_one_document_in_the_prefix_workload():
    specs = load_mix("prefix-shared").sample(20, seed=0)
    assert all(s.prefix_group == 0 and s.shared_prefix_tokens == 2000 for s in specs)
    assert all(2020 <= s.prompt_tokens <= 2100 for s in specs)


def test_it_reads_fixed_lengths():
    assert load_mix("fixed:256:64").sample(3) == [RequestSpec(256, 64)] * 3


@pytest.mark.parametrize("spec", ["fixed:256", "fixed:a:64", "fixed:0:64"])
def test_it_refuses_bad_fixed_lengths(spec):
    with pytest.raises(InputError) as caught:
        load_mix(spec)
    assert caught.value.field == "mix"
    assert "fixed:<in>:<out>" in str(caught.value)


def test_it_names_the_presets_for_an_unknown_mix():
    with pytest.raises(InputError) as caught:
        load_mix("field_mix")
    assert "field-mix" in str(caught.value) and "short-qa" in str(caught.value)


def test_it_refuses_shares_that_do_not_add_to_100_percent():
    with pytest.raises(InputError) as caught:
        Mix("bad", (Bucket(0.5, (1, 2), (1, 2)), Bucket(0.4, (1, 2), (1, 2))))
    assert caught.value.field == "mix"
    assert "90 %" in str(caught.value)


def test_it_reads_a_mix_file(tmp_path):
    path = tmp_path / "chat.json"
    path.write_text(
        json.dumps(
            {
                "buckets": [
                    {"share": 0.75, "prompt": [10, 20], "output": 5},
                    {"share": 0.25, "prompt": 900, "output": [1, 3]},
                ]
            }
        )
    )
    mix = load_mix(str(path), allow_files=True)
    assert mix.name == "chat"
    assert mix.buckets[0] == Bucket(0.75, (10, 20), (5, 5))
    assert len(mix.sample(8)) == 8


def test_it_refuses_a_mix_file_whose_shares_do_not_add_up(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"buckets": [{"share": 0.7, "prompt": 10, "output": 5}]}))
    with pytest.raises(InputError, match="70 %"):
        load_mix(str(path), allow_files=True)


def test_it_says_when_a_mix_file_is_missing(tmp_path):
    with pytest.raises(InputError, match="cannot read mix file"):
        load_mix(str(tmp_path / "nope.json"), allow_files=True)


def test_it_reads_no_file_unless_the_caller_allows_files(tmp_path):
    """From HTTP a path must neither be read nor tell whether it exists."""
    path = tmp_path / "chat.json"
    path.write_text(json.dumps({"buckets": [{"share": 1, "prompt": 10, "output": 5}]}))
    answers = []
    for spec in (str(path), str(tmp_path / "nope.json"), str(tmp_path)):
        with pytest.raises(InputError) as caught:
            load_mix(spec)
        assert caught.value.field == "mix"
        answers.append(str(caught.value).replace(spec, "<spec>"))
    assert len(set(answers)) == 1
    assert "inline JSON" in answers[0] and "path" not in answers[0]


def test_it_reads_an_inline_json_mix():
    mix = load_mix('{"name": "chat", "buckets": [{"share": 0.5, "prompt": 10, "output": 5}, '
                   '{"share": 0.5, "prompt": [20, 30], "output": 7}]}')  # fmt: skip
    assert mix.name == "chat"
    assert mix.buckets[1] == Bucket(0.5, (20, 30), (7, 7))


@pytest.mark.parametrize(
    "spec",
    [
        "fixed:9999999999:64",
        "fixed:64:200000",
        '{"buckets": [{"share": 1, "prompt": [1, 10000000], "output": 5}]}',
        '{"buckets": [{"share": 1, "prompt": 1, "output": 5}], "shared_prefix_tokens": 10000000}',
        '{"buckets": [' + ", ".join(['{"share": 0.025, "prompt": 1, "output": 1}'] * 40) + "]}",
        '{"buckets": [{"share": 1, "prompt": 1, "output": 1}], "pad": "' + "x" * 5000 + '"}',
        "{not json",
    ],
)
def test_it_bounds_what_a_mix_may_ask_for(spec):
    with pytest.raises(InputError) as caught:
        load_mix(spec)
    assert caught.value.field == "mix"


def test_it_shortens_prompts_to_fit_the_context_and_keeps_outputs():
    from inference.loadgen.workloads import RequestSpec, fit_to_context

    assert fit_to_context(RequestSpec(3900, 400), 4096) == RequestSpec(3696, 400)
    assert fit_to_context(RequestSpec(1000, 400), 4096) == RequestSpec(1000, 400)
    assert fit_to_context(RequestSpec(3900, 400), None) == RequestSpec(3900, 400)
    assert fit_to_context(RequestSpec(3900, 400, 0, 2000), 2048).shared_prefix_tokens == 1648
