"""The inventory API: signed-in users read, staff write."""

import pytest

from tests.helpers.clients import api_client
from tests.helpers.samples import nvidia_smi_sample

pytestmark = pytest.mark.django_db


def test_it_lists_nodes_with_their_gpus(dgx, bob):
    response = api_client(bob).get("/api/v1/nodes/")
    assert response.status_code == 200
    [node] = response.json()["results"]
    assert node["queue"] == "node.dgx-v100-01"
    assert len(node["gpus"]) == 8


def test_it_refuses_anonymous_reads(dgx):
    assert api_client().get("/api/v1/nodes/").status_code == 403


def test_it_refuses_writes_from_non_staff(bob):
    response = api_client(bob).post("/api/v1/nodes/", {"name": "n1"}, format="json")
    assert response.status_code == 403


def test_it_lets_staff_add_a_node_and_paste_nvidia_smi_output(alice):
    client = api_client(alice)
    assert client.post("/api/v1/nodes/", {"name": "n1"}, format="json").status_code == 201
    response = client.post(
        "/api/v1/nodes/n1/nvidia-smi/",
        {
            "query_csv": nvidia_smi_sample("v100_pcie_1x_query.csv"),
            "topology": nvidia_smi_sample("v100_pcie_1x_topo.txt"),
        },
        format="json",
    )
    assert response.status_code == 200
    assert [g["catalog_key"] for g in response.json()["gpus"]] == ["v100-pcie-16gb"]


def test_it_fills_a_hand_entered_gpu_from_the_catalog(alice, cpu_node):
    response = api_client(alice).post(
        "/api/v1/gpus/",
        {
            "node": "local",
            "index": 0,
            "name": "Tesla V100-PCIE-32GB",
            "catalog_key": "v100-pcie-32gb",
            "memory_mib": 32768,
        },
        format="json",
    )
    assert response.status_code == 201, response.json()
    assert response.json()["bandwidth_gb_s"] == 900
    assert response.json()["compute_capability"] == "7.0"


def test_it_names_the_field_of_a_bad_hand_entered_gpu(alice, cpu_node):
    response = api_client(alice).post(
        "/api/v1/gpus/",
        {"node": "local", "index": 0, "name": "x", "catalog_key": "v999", "memory_mib": 1},
        format="json",
    )
    assert response.status_code == 400
    assert "catalog_key" in response.json()


def test_it_rejects_a_negative_memory(alice, cpu_node):
    response = api_client(alice).post(
        "/api/v1/gpus/",
        {"node": "local", "index": 0, "name": "x", "catalog_key": "t4", "memory_mib": -5},
        format="json",
    )
    assert response.status_code == 400
    assert "memory_mib" in response.json()
