"""`manage.py inject_gpu_fault`: a GPU failure rehearsed on a simulated node, through the service the
real sampler records its samples with."""

from __future__ import annotations

import io

import pytest
from django.core.management import CommandError, call_command

from portal.inventory.models import Gpu

pytestmark = pytest.mark.django_db


@pytest.fixture
def sim_dgx(dgx):
    dgx.engine = "sim"
    dgx.save(update_fields=["engine"])
    return dgx


def inject(*args: str) -> str:
    out = io.StringIO()
    call_command("inject_gpu_fault", *args, stdout=out)
    return out.getvalue()


def test_it_marks_a_gpu_with_uncorrectable_ecc_errors_degraded_and_says_why(sim_dgx):
    printed = inject("--node", sim_dgx.name, "--gpu", "3", "--kind", "ecc")
    gpu = Gpu.objects.get(node=sim_dgx, index=3)
    assert gpu.health_state == "degraded"
    assert [f["code"] for f in gpu.health_findings] == ["ecc_uncorrectable"]
    assert "dgx-v100-01:3 is degraded" in printed and "uncorrectable ECC" in printed
    assert set(Gpu.objects.filter(node=sim_dgx).exclude(index=3).values_list("health_state", flat=True)) == {
        "healthy"
    }


def test_it_marks_a_gpu_that_fell_off_the_bus_lost(sim_dgx):
    inject("--node", sim_dgx.name, "--gpu", "5", "--kind", "xid79")
    gpu = Gpu.objects.get(node=sim_dgx, index=5)
    assert gpu.health_state == "lost"
    assert "xid_79" in {f["code"] for f in gpu.health_findings}


def test_it_warns_of_a_hot_gpu_without_calling_it_sick(sim_dgx):
    inject("--node", sim_dgx.name, "--gpu", "0", "--kind", "hot")
    gpu = Gpu.objects.get(node=sim_dgx, index=0)
    assert gpu.health_state == "warning" and [f["code"] for f in gpu.health_findings] == ["hot"]


def test_it_leaves_a_real_nodes_readings_to_its_agent(dgx):
    with pytest.raises(CommandError, match="not a simulated node"):
        inject("--node", dgx.name, "--gpu", "3", "--kind", "ecc")
    assert Gpu.objects.get(node=dgx, index=3).health_state != "degraded"


def test_it_names_the_gpus_a_node_has_when_the_index_is_wrong(sim_dgx):
    with pytest.raises(CommandError, match=r"no GPU 9 \(its GPUs: 0, 1, 2, 3, 4, 5, 6, 7\)"):
        inject("--node", sim_dgx.name, "--gpu", "9", "--kind", "ecc")
