"""POST /api/v1/plan/: the planner over HTTP."""

import json

import pytest

from tests.helpers.clients import api_client

pytestmark = pytest.mark.django_db

LLAMA_CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
    "torch_dtype": "float16",
}


def test_it_plans_a_bundled_model_for_any_signed_in_user(bob):
    response = api_client(bob).post(
        "/api/v1/plan/", {"gpu": "v100-sxm2-32gb", "gpus": 8, "model": "llama-2-7b-chat-hf"}, format="json"
    )
    assert response.status_code == 200
    assert response.json()["ok"] is True
    assert response.json()["tensor_parallel_size"] == 8


def test_it_answers_400_naming_the_field_for_a_bad_setting(bob):
    response = api_client(bob).post(
        "/api/v1/plan/",
        {"gpu": "v100-sxm2-32gb", "gpus": 1, "model": "llama-2-7b-chat-hf", "gpu_memory_utilization": 3},
        format="json",
    )
    assert response.status_code == 400
    assert "gpu_memory_utilization" in response.json()


def test_it_refuses_paths_over_the_api(bob):
    response = api_client(bob).post(
        "/api/v1/plan/", {"gpu": "t4", "gpus": 1, "model": "/etc/passwd"}, format="json"
    )
    assert response.status_code == 400
    assert "model" in response.json()


def test_it_resolves_only_registered_or_bundled_names_never_a_relative_path(bob, tmp_path, monkeypatch):
    """A name without a slash that happens to be a directory here must not reach the filesystem."""
    (tmp_path / "probe").mkdir()
    (tmp_path / "probe" / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    monkeypatch.chdir(tmp_path)
    answers = [
        api_client(bob).post("/api/v1/plan/", {"gpu": "t4", "gpus": 1, "model": name}, format="json")
        for name in ("probe", "missing", "..")
    ]
    assert [response.status_code for response in answers] == [400, 400, 400]
    # The same answer whether the directory exists or not: no oracle for the server's files.
    messages = [response.json()["model"][0].split("'")[2] for response in answers]
    assert len(set(messages)) == 1 and "bundled" in messages[0]


def test_it_refuses_anonymous_callers():
    response = api_client().post("/api/v1/plan/", {"gpu": "t4", "gpus": 1, "model": "x"}, format="json")
    assert response.status_code == 403
