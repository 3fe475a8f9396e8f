"""Prompt token counts: the model's tokenizer.json when readable, else 4 characters per token."""

from __future__ import annotations

from portal.gateway.tokens import MESSAGE_OVERHEAD_TOKENS, prompt_tokens
from tests.helpers.tokens import word_tokenizer


def test_it_counts_with_the_models_tokenizer(tmp_path):
    path = word_tokenizer(tmp_path / "tokenizer.json")
    body = {"prompt": "hello world hello"}
    assert prompt_tokens(body, chat=False, tokenizer_path=path) == 3


def test_it_counts_chat_messages_with_a_per_message_overhead(tmp_path):
    path = word_tokenizer(tmp_path / "tokenizer.json")
    body = {"messages": [{"role": "system", "content": "hello"}, {"role": "user", "content": [
        {"type": "text", "text": "world world"}]}]}  # fmt: skip
    assert prompt_tokens(body, chat=True, tokenizer_path=path) == 3 + 2 * MESSAGE_OVERHEAD_TOKENS


def test_it_estimates_four_characters_per_token_without_a_tokenizer(tmp_path):
    assert prompt_tokens({"prompt": "x" * 4000}, chat=False, tokenizer_path=None) == 1000
    assert prompt_tokens({"prompt": "x" * 10}, chat=False, tokenizer_path=str(tmp_path / "missing.json")) == 3


def test_it_counts_token_id_prompts_as_given():
    assert prompt_tokens({"prompt": [1, 2, 3, 4]}, chat=False, tokenizer_path=None) == 4


def test_it_counts_tools_functions_and_documents_as_prompt_text():
    short = {"messages": [{"role": "user", "content": "hi"}]}
    base = prompt_tokens(short, chat=True, tokenizer_path=None)
    tools = [{"type": "function", "function": {"name": "f", "description": "x" * 4000}}]
    assert prompt_tokens({**short, "tools": tools}, chat=True, tokenizer_path=None) > base + 1000
    assert prompt_tokens({**short, "functions": tools}, chat=True, tokenizer_path=None) > base + 1000
    documents = [{"title": "t", "text": "y" * 4000}]
    assert prompt_tokens({**short, "documents": documents}, chat=True, tokenizer_path=None) > base + 1000


def test_it_counts_non_text_content_parts_and_other_message_fields():
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 8000}}
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]}
    assert prompt_tokens(body, chat=True, tokenizer_path=None) > 2000
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "z" * 4000}}
    body = {"messages": [{"role": "assistant", "content": None, "tool_calls": [call]}]}
    assert prompt_tokens(body, chat=True, tokenizer_path=None) > 1000


def test_it_counts_every_prompt_of_a_batch_and_the_suffix(tmp_path):
    path = word_tokenizer(tmp_path / "tokenizer.json")
    body = {"prompt": ["hello", "hello world", [5, 6, 7]], "suffix": "world world"}
    assert prompt_tokens(body, chat=False, tokenizer_path=path) == 1 + 2 + 3 + 2
