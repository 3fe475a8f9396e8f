"""Tensor-parallel groups judged on real `nvidia-smi topo -m` outputs (tests/fixtures/gpu/real/)."""

from __future__ import annotations

import itertools

import pytest

from inference.nvidia_smi import LinkKind, parse_topology
from inference.tp_topology import advise_tp_group, best_tp_group, has_nvlink_ring, is_nvlink_mesh
from tests.helpers.real_gpu import real_gpu_output
from tests.helpers.samples import nvidia_smi_sample

FOURS = list(itertools.combinations(range(8), 4))


@pytest.fixture(scope="module")
def dgx1():
    return parse_topology(real_gpu_output("topo-dgx1-v100-sxm2-8x-microway.txt"))


@pytest.fixture(scope="module")
def rtx4090():
    return parse_topology(real_gpu_output("topo-rtx4090-8x-pcie-go-gpuallocator-17.txt"))


@pytest.fixture(scope="module")
def h100():
    return parse_topology(real_gpu_output("topo-h100-4x-nv6-nccl-1617.txt"))


def codes(findings):
    return {finding.code: finding.level for finding in findings}


def test_it_finds_an_nvlink_ring_in_only_8_of_the_70_four_gpu_groups_of_a_dgx1(dgx1):
    rings = [group for group in FOURS if has_nvlink_ring(dgx1, group)]

    assert (len(FOURS), len(rings)) == (70, 8)


def test_it_finds_only_0123_and_4567_as_full_nvlink_meshes_of_four_on_a_dgx1(dgx1):
    assert [group for group in FOURS if is_nvlink_mesh(dgx1, group)] == [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_it_warns_0124_on_a_dgx1_that_it_has_no_nvlink_ring(dgx1):
    assert codes(advise_tp_group(dgx1, [0, 1, 2, 4]))["tp_no_nvlink_ring"] == "warning"


def test_it_names_the_full_meshes_first_among_the_good_groups_in_the_warning(dgx1):
    warning = next(f for f in advise_tp_group(dgx1, [0, 1, 2, 4]) if f.code == "tp_no_nvlink_ring")

    assert "on NVLink: {0,1,2,3}, {4,5,6,7}," in warning.message


def test_it_has_nothing_to_say_about_0123_on_a_dgx1(dgx1):
    assert advise_tp_group(dgx1, [0, 1, 2, 3]) == []


def test_it_tells_a_ring_that_is_not_a_mesh_where_the_meshes_are(dgx1):
    assert codes(advise_tp_group(dgx1, [0, 1, 4, 5]))["tp_ring_not_mesh"] == "info"


def test_it_warns_a_dgx1_pair_across_sockets_without_nvlink(dgx1):
    assert codes(advise_tp_group(dgx1, [0, 5])) == {
        "tp_pair_without_nvlink": "warning",
        "tp_spans_sockets": "warning",
    }


def test_it_picks_0123_as_the_best_four_gpus_of_a_dgx1(dgx1):
    assert best_tp_group(dgx1, 4) == (0, 1, 2, 3)


def test_it_picks_the_other_mesh_when_gpu0_is_taken(dgx1):
    assert best_tp_group(dgx1, 4, among=range(1, 8)) == (4, 5, 6, 7)


def test_it_picks_a_double_nvlink_pair_on_a_dgx1(dgx1):
    assert dgx1.link(*best_tp_group(dgx1, 2)) == "NV2"


def test_it_keeps_the_cpu_affinity_of_each_dgx1_gpu(dgx1):
    assert (dgx1.cpu_affinity[0], dgx1.cpu_affinity[7]) == ("0-19,40-59", "20-39,60-79")


def test_it_keeps_the_numa_affinity_of_each_gpu_of_a_consumer_box(rtx4090):
    assert [rtx4090.numa_affinity[i] for i in range(8)] == ["0"] * 4 + ["1"] * 4


def test_it_picks_a_one_socket_pair_on_an_all_sys_consumer_box(rtx4090):
    pair = best_tp_group(rtx4090, 2)

    assert rtx4090.socket(pair[0]) == rtx4090.socket(pair[1])


def test_it_warns_a_consumer_pair_across_sockets_and_names_one_socket_pairs(rtx4090):
    spans = next(f for f in advise_tp_group(rtx4090, [0, 4]) if f.code == "tp_spans_sockets")

    assert (spans.level, "{0,1}" in spans.message) == ("warning", True)


def test_it_only_notes_an_nvlink_mesh_that_spans_numa_nodes(h100):
    assert codes(advise_tp_group(h100, [0, 1, 2, 3])) == {"tp_spans_sockets": "info"}


def test_it_tells_pix_and_pxb_apart_from_the_host_bridge_paths():
    # inference/data's 4-GPU PCIe box (driver 580 layout): GPU0-1 PIX, GPU0-2 PXB, GPU1-2 PHB.
    topology = parse_topology(nvidia_smi_sample("pcie_4x_topo_r580.txt"))

    assert [topology.link_kind(0, 1), topology.link_kind(0, 2), topology.link_kind(1, 2)] == [
        LinkKind.PIX,
        LinkKind.PXB,
        LinkKind.PHB,
    ]


def test_it_names_the_pcie_switch_pair_as_better_than_a_host_bridge_pair():
    topology = parse_topology(nvidia_smi_sample("pcie_4x_topo_r580.txt"))

    warning = next(f for f in advise_tp_group(topology, [1, 2]) if f.code == "tp_pair_without_nvlink")

    assert "better pairs here: {0,1}, {0,2}" in warning.message


def test_it_reads_an_unknown_link_token_in_a_dgx1_as_unknown_for_that_pair_only():
    # Derived from the real DGX-1 output: GPU0-GPU1's NV1 replaced by a token no legend has.
    text = real_gpu_output("topo-dgx1-v100-sxm2-8x-microway.txt")
    odd = text.replace("GPU0\t X \tNV1", "GPU0\t X \tCNS", 1)

    topology = parse_topology(odd)

    assert (topology.link_kind(0, 1), topology.link_kind(1, 0), topology.link_kind(0, 2)) == (
        LinkKind.UNKNOWN,
        LinkKind.NVLINK,
        LinkKind.NVLINK,
    )


def test_it_warns_a_group_whose_link_it_cannot_read():
    # Derived from the real DGX-1 output, as above.
    text = real_gpu_output("topo-dgx1-v100-sxm2-8x-microway.txt").replace(
        "GPU0\t X \tNV1", "GPU0\t X \tN/A", 1
    )

    assert codes(advise_tp_group(parse_topology(text), [0, 1]))["tp_link_unknown"] == "warning"


def test_it_warns_tp4_over_two_nvlink_bridged_pairs_that_no_group_has_a_ring():
    # inference/data's four PCIe GPUs bridged in pairs (NV4), one pair per socket.
    topology = parse_topology(nvidia_smi_sample("bridged_pairs_4x_topo_r580.txt"))

    warning = next(f for f in advise_tp_group(topology, [0, 1, 2, 3]) if f.code == "tp_no_nvlink_ring")

    assert "No group of 4 GPUs on this node has an NVLink ring" in warning.message


def test_it_picks_a_bridged_pair_for_tp2():
    topology = parse_topology(nvidia_smi_sample("bridged_pairs_4x_topo_r580.txt"))

    assert best_tp_group(topology, 2) == (0, 1)
