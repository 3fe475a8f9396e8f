"""Profiles: every vLLM knob, refused clearly when impossible."""

import pytest

from portal.deployments.models import DeploymentProfile
from tests.helpers.clients import api_client

pytestmark = pytest.mark.django_db

GOOD = {
    "name": "p1",
    "dtype": "float16",
    "tensor_parallel_size": 1,
    "gpu_memory_utilization": 0.93,
    "enforce_eager": True,
}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("gpu_memory_utilization", 1.5),
        ("gpu_memory_utilization", -0.1),
        ("tensor_parallel_size", 0),
        ("max_num_seqs", 0),
        ("block_size", 17),
        ("dtype", "float8"),
        ("max_model_len", 0),
        ("swap_space_gb", -1),
        ("target_gpu", "v999"),
        ("extra_args", [1, 2]),
    ],
)
def test_it_names_the_field_of_an_impossible_setting(alice, field, value):
    response = api_client(alice).post("/api/v1/profiles/", {**GOOD, field: value}, format="json")
    assert response.status_code == 400
    assert field in response.json()
    assert not DeploymentProfile.objects.exists()


def test_it_stores_every_knob(alice, llama7b):
    body = {
        **GOOD,
        "model_version": llama7b.name,
        "target_gpu": "V100-SXM2-32GB",
        "target_gpu_count": 8,
        "tensor_parallel_size": 8,
        "max_model_len": 4096,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 4096,
        "block_size": 32,
        "enable_prefix_caching": True,
        "enable_chunked_prefill": True,
        "quantization": "",
        "swap_space_gb": 8,
        "kv_cache_dtype": "auto",
        "extra_args": ["--seed", "0"],
    }
    response = api_client(alice).post("/api/v1/profiles/", body, format="json")
    assert response.status_code == 201, response.json()
    profile = DeploymentProfile.objects.get(name="p1")
    assert profile.target_gpu == "v100-sxm2-32gb"  # normalised to the catalog key
    assert (profile.block_size, profile.extra_args) == (32, ["--seed", "0"])
    assert response.json()["plan"]["ok"] is True


def test_it_shows_findings_for_a_profile_that_skips_eager_mode_on_volta(alice, llama7b):
    response = api_client(alice).post(
        "/api/v1/profiles/",
        {
            **GOOD,
            "enforce_eager": False,
            "model_version": llama7b.name,
            "target_gpu": "v100-sxm2-32gb",
            "max_model_len": 4096,
        },
        format="json",
    )
    codes = [f["code"] for f in response.json()["plan"]["findings"]]
    assert "eager_off_on_volta" in codes
