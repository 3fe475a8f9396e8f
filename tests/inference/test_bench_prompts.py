"""Prompts built to an exact token count with a real tokenizer.json."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from inference.errors import InputError
from inference.loadgen.prompts import _CORPUS, EstimatingPromptBuilder, PromptBuilder, prompt_builder
from inference.loadgen.workloads import RequestSpec, load_mix


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A small byte-level BPE that adds a BOS token, like a Llama tokenizer."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"])
    tokenizer.train_from_iterator(_CORPUS * 20, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    from tokenizers import decoders

    tokenizer.decoder = decoders.ByteLevel()
    path = tmp_path_factory.mktemp("tok")
    tokenizer.save(str(path / "tokenizer.json"))
    return path


@pytest.mark.parametrize("mix", ["field-mix", "short-qa", "prefix-shared", "fixed:256:64"])
def test_it_builds_prompts_of_exactly_the_asked_token_count(tokenizer_dir, mix):
    builder = PromptBuilder(tokenizer_dir)
    for i, spec in enumerate(load_mix(mix).sample(12, seed=5)):
        assert builder.count(builder.build(spec, seed=i)) == spec.prompt_tokens


def test_it_counts_the_special_tokens_the_tokenizer_adds(tokenizer_dir):
    assert PromptBuilder(tokenizer_dir).special_tokens == 1


def test_it_shares_the_document_between_requests_of_a_prefix_group(tokenizer_dir):
    builder = PromptBuilder(tokenizer_dir)
    a, b = (builder.build(spec, seed=i) for i, spec in enumerate(load_mix("prefix-shared").sample(2)))
    document = builder.document(0, 2000)
    assert a.startswith(document) and b.startswith(document)
    assert a != b


def test_it_builds_the_same_text_for_the_same_seed(tokenizer_dir):
    builder = PromptBuilder(tokenizer_dir)
    spec = RequestSpec(300, 10)
    assert builder.build(spec, seed=3) == builder.build(spec, seed=3)
    assert builder.build(spec, seed=3) != builder.build(spec, seed=4)


def test_it_falls_back_to_a_stated_estimate_without_a_tokenizer():
    builder = prompt_builder(None)
    assert isinstance(builder, EstimatingPromptBuilder)
    assert builder.exact is False
    assert "estimate" in builder.source
    assert len(builder.build(RequestSpec(100, 1), seed=0)) == 400


def test_it_refuses_a_missing_tokenizer(tmp_path):
    with pytest.raises(InputError) as caught:
        prompt_builder(tmp_path / "nope")
    assert caught.value.field == "tokenizer"
