"""Nodes learn their GPUs from nvidia-smi output, all or nothing."""

import pytest

from inference.nvidia_smi import (
    QUERY_COMMAND,
    QUERY_FIELDS,
    TOPO_COMMAND,
    Discovery,
    discover,
    parse_topology,
    query_command,
    read_query_csv,
)
from portal.core.errors import ApplicationError
from portal.inventory.models import Gpu, GpuHealth, Interconnect
from portal.inventory.services import node_apply_driver_discovery, node_apply_nvidia_smi_text, node_create
from tests.helpers.clients import api_client
from tests.helpers.real_gpu import ScriptedNvidiaSmi, answered, real_gpu_output
from tests.helpers.samples import nvidia_smi_sample

WITHOUT_COMPUTE_CAP = query_command(f for f in QUERY_FIELDS if f != "compute_cap")

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


# --- the node's own driver (issue 34): rows are never deleted for an empty answer -----------


def test_it_keeps_a_dgx_s_gpus_as_lost_when_the_driver_finds_no_devices(dgx):
    node_apply_driver_discovery(node=dgx, discovery=Discovery(no_answer="No devices were found"))

    assert list(dgx.gpus.values_list("health_state", flat=True)) == [GpuHealth.LOST] * 8


def test_it_says_why_a_gpu_is_lost_when_the_driver_finds_no_devices(dgx):
    node_apply_driver_discovery(node=dgx, discovery=Discovery(no_answer="No devices were found"))

    finding = dgx.gpus.get(index=0).health_findings[0]
    assert "the driver listed no GPUs (No devices were found)" in finding["message"]


def test_it_marks_only_the_gpu_of_an_unreadable_row_lost(dgx):
    # Derived from the 8x V100 sample: GPU 3's memory replaced by a driver token.
    text = nvidia_smi_sample("v100_sxm2_8x_query.csv").replace(
        "0B:00.0, 32768 MiB", "0B:00.0, [GPU requires reset]"
    )
    report = read_query_csv(text)
    topology = parse_topology(nvidia_smi_sample("v100_sxm2_8x_topo.txt"))
    discovery = Discovery(readings=report.readings, topology=topology, problems=report.problems)

    node_apply_driver_discovery(node=dgx, discovery=discovery)

    lost = list(dgx.gpus.filter(health_state=GpuHealth.LOST).values_list("index", flat=True))
    assert (lost, dgx.gpus.count()) == ([3], 8)


def test_it_registers_a_470_driver_node_and_notes_the_field_it_lacks(cpu_node):
    run = ScriptedNvidiaSmi(
        {
            tuple(QUERY_COMMAND): answered(
                QUERY_COMMAND, returncode=2, stdout=real_gpu_output("query-r470-compute-cap-not-valid.txt")
            ),
            tuple(WITHOUT_COMPUTE_CAP): answered(
                WITHOUT_COMPUTE_CAP,
                # Derived from the 8x V100 sample: the column a 470 driver cannot print left out.
                stdout=nvidia_smi_sample("v100_sxm2_8x_query.csv")
                .replace(", compute_cap", "")
                .replace(", 7.0,", ","),
            ),
            tuple(TOPO_COMMAND): answered(
                TOPO_COMMAND, stdout=real_gpu_output("topo-dgx1-v100-sxm2-8x-microway.txt")
            ),
        }
    )

    gpus = node_apply_driver_discovery(node=cpu_node, discovery=discover(run))

    cpu_node.refresh_from_db()
    assert ({g.compute_capability for g in gpus}, len(gpus)) == ({"7.0"}, 8)
    assert any("compute_cap" in note for note in cpu_node.discovery_notes)


def test_it_stores_the_topology_the_driver_printed(cpu_node):
    run = ScriptedNvidiaSmi(
        {
            tuple(QUERY_COMMAND): answered(QUERY_COMMAND, stdout=nvidia_smi_sample("v100_sxm2_8x_query.csv")),
            tuple(TOPO_COMMAND): answered(
                TOPO_COMMAND, stdout=real_gpu_output("topo-dgx1-v100-sxm2-8x-microway.txt")
            ),
        }
    )

    node_apply_driver_discovery(node=cpu_node, discovery=discover(run))

    cpu_node.refresh_from_db()
    assert "mlx5_0" in cpu_node.topology_text


def test_it_shows_on_the_node_page_why_its_gpus_are_lost(client, bob, dgx):
    node_apply_driver_discovery(node=dgx, discovery=Discovery(no_answer="No devices were found"))
    client.force_login(bob)

    page = client.get(dgx.get_absolute_url()).content.decode()

    assert "the driver listed no GPUs: No devices were found" in page


def test_it_serves_what_the_last_discovery_could_not_read_over_the_api(alice, dgx):
    node_apply_driver_discovery(node=dgx, discovery=Discovery(no_answer="No devices were found"))

    data = api_client(alice).get(f"/api/v1/nodes/{dgx.name}/").json()

    assert data["discovery_notes"] == ["the driver listed no GPUs: No devices were found"]


def test_it_keeps_a_dgx_s_gpus_when_pasted_output_says_no_devices_were_found(dgx):
    node_apply_nvidia_smi_text(node=dgx, query_csv=nvidia_smi_sample("no_devices.txt"))

    assert list(dgx.gpus.values_list("health_state", flat=True)) == [GpuHealth.LOST] * 8
