"""Tests for reading GPUs and their topology from nvidia-smi output."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from inference.errors import InputError
from inference.nvidia_smi import (
    QUERY_COMMAND,
    QUERY_FIELDS,
    TOPO_COMMAND,
    GpuReading,
    LinkKind,
    Topology,
    discover,
    discover_local,
    parse_query_csv,
    parse_topology,
    query_command,
    read_query_csv,
)
from tests.helpers.real_gpu import ScriptedNvidiaSmi, real_gpu_output

# Real-shaped nvidia-smi output ships with the package: seed_demo builds its demo nodes from it.
FIXTURES = Path(__file__).resolve().parents[2] / "inference" / "data" / "nvidia_smi"

HEADER = "index, name, uuid, pci.bus_id, memory.total [MiB], compute_cap, driver_version"
ROW = (
    "0, Tesla V100-PCIE-16GB, GPU-2d5f8a1c-7e3b-40c9-96a2-e8b4d1f7c053, 00000000:3B:00.0, 16384 MiB, 7.0, "
    "535.183.01"
)


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


@pytest.fixture(scope="module")
def dgx1() -> Topology:
    return parse_topology(fixture("v100_sxm2_8x_topo.txt"))


@pytest.fixture(scope="module")
def pcie4() -> Topology:
    return parse_topology(fixture("v100_pcie_4x_topo.txt"))


class FakeRun:
    """Stands in for subprocess.run: answers each nvidia-smi command from a table."""

    def __init__(self, answers: dict[tuple[str, ...], subprocess.CompletedProcess[str] | Exception]):
        self.answers = answers

    def __call__(self, argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        answer = self.answers[tuple(argv)]
        if isinstance(answer, Exception):
            raise answer
        return answer


def done(argv: list[str], returncode: int = 0, stdout: str = "", stderr: str = ""):
    return subprocess.CompletedProcess(argv, returncode, stdout=stdout, stderr=stderr)


# --- the query CSV ---------------------------------------------------------------


def test_it_reads_eight_sxm2_gpus():
    readings = parse_query_csv(fixture("v100_sxm2_8x_query.csv"))

    assert [r.index for r in readings] == list(range(8))
    assert readings[5] == GpuReading(
        index=5,
        name="Tesla V100-SXM2-32GB",
        uuid="GPU-58d1a3f9-7b2c-e046-b81d-4e9f2a6c3d70",
        pci_bus_id="00000000:86:00.0",
        memory_total_mib=32768,
        compute_capability="7.0",
        driver_version="535.183.01",
    )


def test_it_reads_every_sxm2_gpu_as_a_32gb_volta():
    readings = parse_query_csv(fixture("v100_sxm2_8x_query.csv"))

    assert {(r.name, r.memory_total_mib, r.compute_capability) for r in readings} == {
        ("Tesla V100-SXM2-32GB", 32768, "7.0")
    }


def test_it_reads_the_single_gpu_box():
    readings = parse_query_csv(fixture("v100_pcie_1x_query.csv"))

    assert [(r.index, r.name, r.memory_total_mib) for r in readings] == [(0, "Tesla V100-PCIE-16GB", 16384)]


def test_it_reads_noheader_nounits_output():
    readings = parse_query_csv(fixture("noheader_nounits.csv"))

    assert readings == parse_query_csv(fixture("v100_pcie_1x_query.csv"))


def test_it_matches_columns_by_header_name_in_any_order():
    text = (
        "driver_version, memory.total [MiB], uuid, index, compute_cap, pci.bus_id, name\n"
        "535.183.01, 16384 MiB, GPU-2d5f8a1c-7e3b-40c9-96a2-e8b4d1f7c053, 0, 7.0, 00000000:3B:00.0, "
        "Tesla V100-PCIE-16GB\n"
    )

    assert parse_query_csv(text) == parse_query_csv(fixture("v100_pcie_1x_query.csv"))


def test_it_reads_na_compute_cap_as_none():
    readings = parse_query_csv(f"{HEADER}\n{ROW.replace(', 7.0,', ', [N/A],')}\n")

    assert readings[0].compute_capability is None


def test_it_reads_not_supported_driver_version_as_none():
    readings = parse_query_csv(f"{HEADER}\n{ROW.replace('535.183.01', '[Not Supported]')}\n")

    assert readings[0].driver_version is None


def test_it_reads_a_header_without_optional_columns():
    text = "index, name, uuid, pci.bus_id, memory.total [MiB]\n" + ROW.rsplit(", ", 2)[0] + "\n"

    assert parse_query_csv(text)[0].compute_capability is None


def test_it_reads_no_devices_as_no_gpus():
    assert parse_query_csv(fixture("no_devices.txt")) == []


def test_it_reads_empty_output_as_no_gpus():
    assert parse_query_csv("") == []


def test_it_names_the_line_of_a_row_with_too_few_values():
    text = f"{HEADER}\n{ROW}\n1, Tesla V100-PCIE-16GB, GPU-abc\n"

    with pytest.raises(InputError, match=r"^nvidia-smi: line 3: expected 7 values, found 3$"):
        parse_query_csv(text)


def test_it_names_the_line_of_a_memory_value_that_is_not_a_number():
    text = f"{HEADER}\n{ROW.replace('16384 MiB', '16 GB')}\n"

    with pytest.raises(InputError, match=r"^nvidia-smi: line 2: memory.total '16 GB'"):
        parse_query_csv(text)


def test_it_refuses_a_missing_required_value():
    text = f"{HEADER}\n{ROW.replace('00000000:3B:00.0', '[N/A]')}\n"

    with pytest.raises(InputError, match=r"line 2: pci.bus_id is missing"):
        parse_query_csv(text)


def test_it_refuses_a_header_without_uuid():
    text = "index, name, pci.bus_id, memory.total [MiB]\n0, Tesla V100-PCIE-16GB, 00000000:3B:00.0, 16384\n"

    with pytest.raises(InputError, match=r"^nvidia-smi: line 1: header lacks uuid$"):
        parse_query_csv(text)


def test_it_refuses_a_gpu_index_listed_twice():
    with pytest.raises(InputError, match=r"line 3: GPU index 0 appears twice"):
        parse_query_csv(f"{HEADER}\n{ROW}\n{ROW}\n")


def test_it_reports_the_field_as_nvidia_smi():
    with pytest.raises(InputError) as caught:
        parse_query_csv("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n")

    assert caught.value.field == "nvidia-smi"


# --- the topology matrix -----------------------------------------------------------


def test_it_reads_the_dgx1_gpu0_row_as_printed(dgx1):
    assert [dgx1.link(0, j) for j in range(8)] == ["X", "NV1", "NV1", "NV2", "NV2", "SYS", "SYS", "SYS"]


def test_it_keeps_nic_columns_out_of_the_links(dgx1):
    assert dgx1.indices == list(range(8))
    assert len(dgx1.links) == 8 * 7


def test_it_finds_gpu0s_nvlink_peers_on_a_dgx1(dgx1):
    assert dgx1.nvlink_peers(0) == [1, 2, 3, 4]


def test_it_finds_gpu6s_nvlink_peers_on_a_dgx1(dgx1):
    assert dgx1.nvlink_peers(6) == [2, 4, 5, 7]


def test_it_sees_all_eight_dgx1_gpus_as_nvlink_connected(dgx1):
    assert dgx1.nvlink_connected(range(8)) is True


def test_it_sees_a_directly_linked_pair_as_nvlink_connected(dgx1):
    assert dgx1.nvlink_connected([0, 1]) is True


def test_it_sees_a_sys_pair_as_not_nvlink_connected(dgx1):
    assert dgx1.nvlink_connected([0, 5]) is False


def test_it_connects_a_group_through_a_member_when_the_ends_are_not_linked(dgx1):
    # GPU0 and GPU7 are SYS apart, but GPU3 is NVLinked to both.
    assert dgx1.nvlink_connected([0, 3, 7]) is True


def test_it_sees_two_quads_across_sockets_as_nvlink_connected(dgx1):
    assert dgx1.nvlink_connected([0, 1, 4, 5]) is True


def test_it_sees_a_single_gpu_as_nvlink_connected(dgx1):
    assert dgx1.nvlink_connected([6]) is True


def test_it_sees_an_empty_group_as_not_nvlink_connected(dgx1):
    assert dgx1.nvlink_connected([]) is False


def test_it_refuses_a_group_with_a_gpu_the_node_lacks(dgx1):
    with pytest.raises(KeyError, match="GPU"):
        dgx1.nvlink_connected([0, 8])


def test_it_summarises_a_dgx1_as_nvlink(dgx1):
    assert dgx1.interconnect_summary() == "nvlink"


def test_it_reads_the_pre_r520_dgx1_layout_the_same(dgx1):
    older = parse_topology(fixture("v100_sxm2_8x_topo_r450.txt"))  # no NUMA column before r520

    assert (older.links, older.gpus, older.cpu_affinity) == (dgx1.links, dgx1.gpus, dgx1.cpu_affinity)


def test_it_finds_no_nvlink_on_the_pcie_box(pcie4):
    assert [pcie4.nvlink_peers(i) for i in range(4)] == [[], [], [], []]


def test_it_summarises_the_pcie_box_as_pcie(pcie4):
    assert pcie4.interconnect_summary() == "pcie"


def test_it_sees_a_pcie_pair_as_not_nvlink_connected(pcie4):
    assert pcie4.nvlink_connected([0, 1]) is False


def test_it_reads_the_pcie_paths_as_printed(pcie4):
    assert (pcie4.link(0, 1), pcie4.link(2, 3), pcie4.link(1, 2)) == ("PIX", "NODE", "SYS")


def test_it_reads_a_one_gpu_matrix():
    topology = parse_topology(fixture("v100_pcie_1x_topo.txt"))

    assert (topology.indices, topology.links, topology.interconnect_summary()) == ([0], {}, "none")


def test_it_tolerates_a_matrix_aligned_with_spaces():
    text = fixture("v100_pcie_4x_topo.txt").replace("\t", "   ")

    assert parse_topology(text) == parse_topology(fixture("v100_pcie_4x_topo.txt"))


def test_it_tolerates_a_header_that_lost_its_indent():
    text = fixture("v100_pcie_4x_topo.txt").lstrip()

    assert parse_topology(text) == parse_topology(fixture("v100_pcie_4x_topo.txt"))


def test_it_reads_an_empty_topology_as_no_gpus():
    assert parse_topology("").interconnect_summary() == "none"


def test_it_refuses_a_topology_without_a_header():
    with pytest.raises(InputError, match=r"^nvidia-smi topo: no matrix header"):
        parse_topology("GPU0\t X \t0-11\n")


def test_it_reads_an_unknown_link_token_as_unknown_for_that_pair_only():
    text = "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNVX\t0-11\nGPU1\tNVX\t X \t0-11\n"

    topology = parse_topology(text)

    assert (topology.link(0, 1), topology.link_kind(0, 1)) == ("NVX", LinkKind.UNKNOWN)


def test_it_refuses_x_off_the_diagonal():
    text = "\tGPU0\tGPU1\nGPU0\t X \t X \nGPU1\tNV1\t X \n"

    with pytest.raises(InputError, match=r"line 2: GPU0-GPU1 is 'X'"):
        parse_topology(text)


def test_it_refuses_a_matrix_missing_a_gpu_row():
    text = "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV1\t0-11\n\nLegend:\n"

    with pytest.raises(InputError, match=r"^nvidia-smi topo: no rows for GPU1$"):
        parse_topology(text)


def test_it_names_the_line_of_a_truncated_row():
    text = "\tGPU0\tGPU1\nGPU0\t X \tNV1\nGPU1\tNV1\n"

    with pytest.raises(InputError, match=r"line 3: GPU1 row ends before GPU1"):
        parse_topology(text)


# --- driver 580's layout: an escaped, tab-led header and three affinity columns -----------


def test_it_reads_the_real_h200_topology_from_driver_580():
    # Byte for byte from an H200 VM: the header starts with a tab and ESC[4m … ESC[0m.
    text = fixture("h200_sxm_1x_topo_r580.txt")
    assert "\x1b[4m" in text

    topology = parse_topology(text)

    assert (topology.links, topology.gpus) == ({}, (0,))
    assert topology.interconnect_summary() == "none"


def test_it_reads_eight_nvswitched_gpus_past_the_nic_and_affinity_columns_of_driver_580():
    topology = parse_topology(fixture("h200_sxm_8x_topo_r580.txt"))

    assert topology.indices == list(range(8))
    assert set(topology.links.values()) == {"NV18"}
    assert topology.nvlink_peers(5) == [0, 1, 2, 3, 4, 6, 7]
    assert topology.interconnect_summary() == "nvlink"


def test_it_reads_every_pcie_path_type_in_the_driver_580_layout():
    topology = parse_topology(fixture("pcie_4x_topo_r580.txt"))

    assert [topology.link(0, peer) for peer in (1, 2, 3)] == ["PIX", "PXB", "SYS"]
    assert [topology.link(1, 2), topology.link(2, 3)] == ["PHB", "NODE"]
    assert topology.interconnect_summary() == "pcie"
    assert not topology.nvlink_connected([0, 1])


def test_it_reads_nvlink_bridged_pairs_in_the_driver_580_layout():
    topology = parse_topology(fixture("bridged_pairs_4x_topo_r580.txt"))

    assert topology.nvlink_connected([0, 1]) and topology.nvlink_connected([2, 3])
    assert not topology.nvlink_connected([0, 1, 2, 3])
    assert topology.link(1, 2) == "SYS"


def test_it_reads_escapes_anywhere_in_the_matrix():
    text = (
        "\t\x1b[4mGPU0\tGPU1\tCPU Affinity\x1b[0m\nGPU0\t X \t\x1b[1mNV2\x1b[0m\t0-7\nGPU1\tNV2\t X \t0-7\n"
    )

    assert parse_topology(text).links == {(0, 1): "NV2", (1, 0): "NV2"}


def test_it_reads_the_real_h200_query_from_driver_580():
    [reading] = parse_query_csv(fixture("h200_sxm_1x_query_r580.csv"))

    assert (reading.name, reading.memory_total_mib, reading.compute_capability, reading.driver_version) == (
        "NVIDIA H200",
        143771,
        "9.0",
        "580.159.04",
    )


@pytest.mark.parametrize(
    ("query", "topo", "count", "summary"),
    [
        ("h200_sxm_1x_query_r580.csv", "h200_sxm_1x_topo_r580.txt", 1, "none"),
        ("h200_sxm_8x_query_r580.csv", "h200_sxm_8x_topo_r580.txt", 8, "nvlink"),
        ("pcie_4x_query_r580.csv", "pcie_4x_topo_r580.txt", 4, "pcie"),
    ],
)
def test_it_discovers_a_driver_580_machine_from_both_commands(query, topo, count, summary):
    run = FakeRun(
        {
            tuple(QUERY_COMMAND): done(QUERY_COMMAND, stdout=fixture(query)),
            tuple(TOPO_COMMAND): done(TOPO_COMMAND, stdout=fixture(topo)),
        }
    )

    readings, topology = discover_local(run)

    assert len(readings) == count
    assert topology.indices == list(range(count))
    assert topology.interconnect_summary() == summary


# --- discovering the local machine --------------------------------------------------


def test_it_discovers_no_gpus_when_nvidia_smi_is_missing():
    run = FakeRun({tuple(QUERY_COMMAND): FileNotFoundError(2, "No such file or directory", "nvidia-smi")})

    readings, topology = discover_local(run)

    assert (readings, topology.interconnect_summary()) == ([], "none")


def test_it_discovers_no_gpus_when_the_driver_is_not_loaded():
    message = (
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
        "Make sure that the latest NVIDIA driver is installed and running.\n"
    )
    run = FakeRun({tuple(QUERY_COMMAND): done(QUERY_COMMAND, returncode=9, stdout=message)})

    assert discover_local(run) == ([], Topology())


def test_it_discovers_no_gpus_when_nvidia_smi_finds_no_devices():
    run = FakeRun({tuple(QUERY_COMMAND): done(QUERY_COMMAND, returncode=6, stdout=fixture("no_devices.txt"))})

    assert discover_local(run) == ([], Topology())


def test_it_discovers_the_dgx1_from_both_commands():
    run = FakeRun(
        {
            tuple(QUERY_COMMAND): done(QUERY_COMMAND, stdout=fixture("v100_sxm2_8x_query.csv")),
            tuple(TOPO_COMMAND): done(TOPO_COMMAND, stdout=fixture("v100_sxm2_8x_topo.txt")),
        }
    )

    readings, topology = discover_local(run)

    assert readings == parse_query_csv(fixture("v100_sxm2_8x_query.csv"))
    assert topology == parse_topology(fixture("v100_sxm2_8x_topo.txt"))


def test_it_reports_the_first_stderr_line_of_another_failure():
    stderr = "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 580.95\n"
    run = FakeRun({tuple(QUERY_COMMAND): done(QUERY_COMMAND, returncode=18, stderr=stderr)})

    with pytest.raises(
        InputError,
        match=r"^nvidia-smi: exited with status 18: Failed to initialize NVML: Driver/library version",
    ):
        discover_local(run)


def test_it_reports_a_topo_failure_under_its_own_field():
    run = FakeRun(
        {
            tuple(QUERY_COMMAND): done(QUERY_COMMAND, stdout=fixture("v100_pcie_1x_query.csv")),
            tuple(TOPO_COMMAND): done(TOPO_COMMAND, returncode=3, stderr="Unable to determine topology\n"),
        }
    )

    with pytest.raises(InputError) as caught:
        discover_local(run)

    assert caught.value.field == "nvidia-smi topo"


def test_it_turns_a_hung_nvidia_smi_into_an_input_error():
    run = FakeRun({tuple(QUERY_COMMAND): subprocess.TimeoutExpired(QUERY_COMMAND, 30)})

    with pytest.raises(InputError, match=r"^nvidia-smi: did not answer within 30 s$"):
        discover_local(run)


def test_it_refuses_a_topology_that_disagrees_with_the_query():
    run = FakeRun(
        {
            tuple(QUERY_COMMAND): done(QUERY_COMMAND, stdout=fixture("v100_sxm2_8x_query.csv")),
            tuple(TOPO_COMMAND): done(TOPO_COMMAND, stdout=fixture("v100_pcie_4x_topo.txt")),
        }
    )

    with pytest.raises(InputError, match=r"^nvidia-smi topo: lists GPUs \[0, 1, 2, 3\]"):
        discover_local(run)


# --- queries that survive the driver (issue 34) --------------------------------------------


def _with_gpu3_row(replace: str, by: str) -> str:
    # Derived from the 8x V100 SXM2 sample: one value of GPU 3's row replaced.
    lines = fixture("v100_sxm2_8x_query.csv").splitlines(keepends=True)
    lines[4] = lines[4].replace(replace, by)
    return "".join(lines)


def test_it_costs_only_its_own_gpu_when_one_row_says_it_requires_a_reset():
    report = read_query_csv(_with_gpu3_row("32768 MiB", "[GPU requires reset]"))

    assert [r.index for r in report.readings] == [0, 1, 2, 4, 5, 6, 7]


def test_it_names_the_gpu_of_an_unreadable_row():
    report = read_query_csv(_with_gpu3_row("32768 MiB", "[GPU requires reset]"))

    assert [(p.line, p.index) for p in report.problems] == [(5, 3)]


def test_it_costs_only_its_own_gpu_when_one_row_has_an_extra_column():
    report = read_query_csv(_with_gpu3_row("535.183.01", "535.183.01, 470"))

    assert (len(report.readings), report.problems[0].message) == (7, "expected 7 values, found 8")


def test_it_reads_an_unreadable_compute_cap_as_unknown_for_that_field_only():
    report = read_query_csv(_with_gpu3_row(", 7.0,", ", ERR!,"))

    assert [r.compute_capability for r in report.readings][3] is None


def test_it_reports_a_duplicate_index_row_and_keeps_the_first():
    text = fixture("v100_sxm2_8x_query.csv")
    doubled = text + text.splitlines(keepends=True)[1]  # derived: GPU 0's row printed twice

    report = read_query_csv(doubled)

    assert (len(report.readings), str(report.problems[0])) == (8, "line 10: GPU index 0 appears twice")


def test_it_reads_a_header_behind_a_utf8_byte_order_mark():
    text = "\ufeff" + fixture("h200_sxm_1x_query_r580.csv")  # derived: a BOM an editor added

    assert [r.name for r in parse_query_csv(text)] == ["NVIDIA H200"]


def _dgx1_answers(query_fields: tuple[str, ...]) -> dict:
    real_470 = real_gpu_output("query-r470-compute-cap-not-valid.txt")
    without = query_command(f for f in query_fields if f != "compute_cap")
    return {
        tuple(QUERY_COMMAND): done(QUERY_COMMAND, returncode=2, stdout=real_470),
        tuple(without): done(
            without,
            stdout=fixture("v100_sxm2_8x_query.csv").replace(", compute_cap", "").replace(", 7.0,", ","),
        ),
        tuple(TOPO_COMMAND): done(
            TOPO_COMMAND, stdout=real_gpu_output("topo-dgx1-v100-sxm2-8x-microway.txt")
        ),
    }


def test_it_asks_a_470_driver_again_without_compute_cap():
    run = ScriptedNvidiaSmi(_dgx1_answers(QUERY_FIELDS))

    found = discover(run)

    assert (len(found.readings), found.lacking_fields) == (8, ("compute_cap",))


def test_it_says_which_fields_the_driver_lacks():
    found = discover(ScriptedNvidiaSmi(_dgx1_answers(QUERY_FIELDS)))

    assert "this driver does not know compute_cap" in " ".join(found.notes())


def test_it_refuses_a_driver_that_lacks_a_field_discovery_needs():
    stdout = 'Field "uuid" is not a valid field to query.\n'  # derived from the real 470 answer
    run = ScriptedNvidiaSmi({tuple(QUERY_COMMAND): done(QUERY_COMMAND, returncode=2, stdout=stdout)})

    with pytest.raises(InputError, match="does not know the field 'uuid'"):
        discover(run)


def test_it_says_why_when_the_driver_answers_nothing():
    stdout = "No devices were found\n"
    run = ScriptedNvidiaSmi({tuple(QUERY_COMMAND): done(QUERY_COMMAND, returncode=6, stdout=stdout)})

    assert discover(run).no_answer == "No devices were found"


def test_it_finds_the_header_below_a_driver_warning():
    # Derived from the real H200 capture: the infoROM warning nvidia-smi prints above its output.
    text = "WARNING: infoROM is corrupted at gpu 0000:04:00.0\n" + fixture("h200_sxm_1x_query_r580.csv")

    report = read_query_csv(text)

    assert ([r.name for r in report.readings], report.problems[0].line) == (["NVIDIA H200"], 1)
