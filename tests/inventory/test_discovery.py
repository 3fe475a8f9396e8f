"""Nodes learn their GPUs from nvidia-smi output, all or nothing."""

import pytest

from portal.core.errors import ApplicationError
from portal.inventory.models import Gpu, Interconnect
from portal.inventory.services import node_apply_nvidia_smi_text, node_create
from tests.helpers.samples import nvidia_smi_sample

pytestmark = pytest.mark.django_db


def test_it_records_eight_nvlinked_v100s_from_a_dgx(dgx):
    gpus = list(dgx.gpus.all())
    assert len(gpus) == 8
    assert {g.catalog_key for g in gpus} == {"v100-sxm2-32gb"}
    assert gpus[0].compute_capability == "7.0"
    assert gpus[0].bandwidth_gb_s == 900
    assert gpus[0].nvlink_peers == [1, 2, 3, 4]
    dgx.refresh_from_db()
    assert dgx.interconnect == Interconnect.NVLINK
    assert dgx.discovered_at is not None


def test_it_marks_a_pcie_box_as_pcie_only(pcie_box):
    pcie_box.refresh_from_db()
    assert pcie_box.interconnect == Interconnect.PCIE
    assert pcie_box.gpus.count() == 4
    assert all(g.nvlink_peers == [] for g in pcie_box.gpus.all())


def test_it_records_a_real_h200_from_driver_580_output(cpu_node):
    gpus = node_apply_nvidia_smi_text(
        node=cpu_node,
        query_csv=nvidia_smi_sample("h200_sxm_1x_query_r580.csv"),
        topology_text=nvidia_smi_sample("h200_sxm_1x_topo_r580.txt"),
    )

    assert [(g.catalog_key, g.compute_capability) for g in gpus] == [("h200-sxm-141gb", "9.0")]
    cpu_node.refresh_from_db()
    assert (cpu_node.interconnect, cpu_node.driver_version) == (Interconnect.NONE, "580.159.04")


def test_it_records_eight_nvswitched_h200s_from_driver_580_output(cpu_node):
    node_apply_nvidia_smi_text(
        node=cpu_node,
        query_csv=nvidia_smi_sample("h200_sxm_8x_query_r580.csv"),
        topology_text=nvidia_smi_sample("h200_sxm_8x_topo_r580.txt"),
    )

    cpu_node.refresh_from_db()
    assert cpu_node.interconnect == Interconnect.NVLINK
    assert cpu_node.gpus.get(index=3).nvlink_peers == [0, 1, 2, 4, 5, 6, 7]


def test_it_accepts_a_node_without_gpus(cpu_node):
    gpus = node_apply_nvidia_smi_text(node=cpu_node, query_csv=nvidia_smi_sample("no_devices.txt"))
    assert gpus == []
    assert cpu_node.is_cpu_only


def test_it_keeps_the_old_gpus_when_new_output_is_malformed(dgx):
    with pytest.raises(ApplicationError) as error:
        node_apply_nvidia_smi_text(node=dgx, query_csv="index, name\n0, broken, extra, columns\n")
    assert error.value.field == "nvidia-smi"
    assert dgx.gpus.count() == 8


def test_it_refuses_a_gpu_the_catalog_lacks_and_saves_nothing(db):
    node = node_create(name="mystery")
    csv = (
        "index, name, uuid, pci.bus_id, memory.total [MiB], compute_cap, driver_version\n"
        "0, Quantum Widget 9000, GPU-1, 00000000:01:00.0, 4096 MiB, 9.9, 1.0\n"
    )
    with pytest.raises(ApplicationError, match="not in the GPU catalog"):
        node_apply_nvidia_smi_text(node=node, query_csv=csv)
    assert not Gpu.objects.filter(node=node).exists()


def test_it_refuses_a_node_name_that_cannot_be_a_queue_name(db):
    with pytest.raises(ApplicationError) as error:
        node_create(name="Bad Name!")
    assert error.value.field == "name"


def test_it_names_the_agent_queue_after_the_node(dgx):
    assert dgx.queue == "node.dgx-v100-01"
