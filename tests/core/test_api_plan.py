"""POST /api/v1/plan/: the planner over HTTP."""

import pytest

from tests.conftest import api_client

pytestmark = pytest.mark.django_db


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


def test_it_refuses_anonymous_callers():
    response = api_client().post("/api/v1/plan/", {"gpu": "t4", "gpus": 1, "model": "x"}, format="json")
    assert response.status_code == 403
