"""What GPUs a node has and how they are wired, read from `nvidia-smi`.

A node agent runs `QUERY_COMMAND` and `TOPO_COMMAND` (or `discover_local` does it)
and the portal parses the text here into `GpuReading`s and a `Topology`. The planner
uses the topology to keep a tensor-parallel group on NVLink: over PCIe 3.0 the
all-reduce of every layer makes TP slow (docs/v100-field-guide.md#hardware).
"""

from __future__ import annotations

import csv
import re
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from inference.errors import InputError

QUERY_FIELDS = (
    "index",
    "name",
    "uuid",
    "pci.bus_id",
    "memory.total",
    "compute_cap",
    "driver_version",
)
QUERY_COMMAND = ["nvidia-smi", "--query-gpu=" + ",".join(QUERY_FIELDS), "--format=csv"]
TOPO_COMMAND = ["nvidia-smi", "topo", "-m"]

# nvidia-smi initialises the driver for each GPU when persistence mode is off,
# which takes seconds on an 8-GPU node; a hung driver must not hang the agent.
COMMAND_TIMEOUT_S = 30

QUERY_SOURCE = "nvidia-smi"
TOPO_SOURCE = "nvidia-smi topo"

# compute_cap joined the queryable fields in later drivers and driver_version is
# informative only, so a header without them still describes usable GPUs.
_OPTIONAL_FIELDS = frozenset({"compute_cap", "driver_version"})
_MISSING_VALUES = frozenset({"[N/A]", "[Not Supported]", "N/A"})
_NO_DEVICES = "No devices were found"
_DRIVER_DOWN = "NVIDIA-SMI has failed"

_MEMORY_RE = re.compile(r"^(\d+)(?:\s*MiB)?$")
_COMPUTE_CAP_RE = re.compile(r"^\d+\.\d+$")
_BUS_ID_RE = re.compile(r"^[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]$")
_UNIT_SUFFIX_RE = re.compile(r"\s*\[[^\]]*\]$")

_GPU_LABEL_RE = re.compile(r"^GPU(\d+)$")
# SOC is what drivers before the SYS/NODE split printed for a cross-socket path.
_LINK_RE = re.compile(r"^(X|NV\d+|PIX|PXB|PHB|NODE|SYS|SOC)$")
_NVLINK_RE = re.compile(r"^NV\d+$")
# Driver 580 underlines the topology header with ANSI escapes (ESC[4m … ESC[0m), even
# when stdout is a pipe; they would glue themselves to the first and last column names.
_ANSI_ESCAPE_RE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


@dataclass(frozen=True)
class GpuReading:
    """One GPU as `nvidia-smi --query-gpu` reports it."""

    index: int
    name: str
    uuid: str
    pci_bus_id: str
    memory_total_mib: int
    compute_capability: str | None  # "7.0" on V100; None when the driver cannot say
    driver_version: str | None


def parse_query_csv(text: str) -> list[GpuReading]:
    """Parse `QUERY_COMMAND` output, with or without header and units.

    With a header the columns are found by name, so a query with the fields in
    another order still parses; without one they must be in `QUERY_FIELDS` order.
    """
    if not text.strip() or text.strip().startswith(_NO_DEVICES):
        return []

    columns: list[str] | None = None
    readings: list[GpuReading] = []
    seen: set[int] = set()
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        cells = [cell.strip() for cell in next(csv.reader([line], skipinitialspace=True))]
        if columns is None:
            columns = _read_header(cells, number)
            if columns is not None:
                continue
            columns = list(QUERY_FIELDS)
        if len(cells) != len(columns):
            raise InputError(
                QUERY_SOURCE, f"line {number}: expected {len(columns)} values, found {len(cells)}"
            )
        reading = _read_row(dict(zip(columns, cells, strict=True)), number)
        if reading.index in seen:
            raise InputError(QUERY_SOURCE, f"line {number}: GPU index {reading.index} appears twice")
        seen.add(reading.index)
        readings.append(reading)
    return readings


def _read_header(cells: list[str], number: int) -> list[str] | None:
    """Column names if `cells` is a header line, else None (a `noheader` data row)."""
    names = [_UNIT_SUFFIX_RE.sub("", cell) for cell in cells]
    if not any(name in QUERY_FIELDS for name in names):
        return None
    missing = [name for name in QUERY_FIELDS if name not in names and name not in _OPTIONAL_FIELDS]
    if missing:
        raise InputError(QUERY_SOURCE, f"line {number}: header lacks {', '.join(missing)}")
    return names


def _read_row(row: dict[str, str], number: int) -> GpuReading:
    def required(name: str) -> str:
        value = row[name]
        if not value or value in _MISSING_VALUES:
            raise InputError(QUERY_SOURCE, f"line {number}: {name} is missing ({value or 'empty'})")
        return value

    def optional(name: str) -> str | None:
        value = row.get(name, "")
        return None if not value or value in _MISSING_VALUES else value

    index = required("index")
    if not index.isdigit():
        raise InputError(QUERY_SOURCE, f"line {number}: index {index!r} is not a number")
    memory = _MEMORY_RE.match(required("memory.total"))
    if memory is None:
        raise InputError(
            QUERY_SOURCE, f"line {number}: memory.total {row['memory.total']!r} is not a MiB count"
        )
    bus_id = required("pci.bus_id")
    if not _BUS_ID_RE.match(bus_id):
        raise InputError(QUERY_SOURCE, f"line {number}: pci.bus_id {bus_id!r} is not a PCI address")
    compute_cap = optional("compute_cap")
    if compute_cap is not None and not _COMPUTE_CAP_RE.match(compute_cap):
        raise InputError(QUERY_SOURCE, f"line {number}: compute_cap {compute_cap!r} is not like 7.0")
    return GpuReading(
        index=int(index),
        name=required("name"),
        uuid=required("uuid"),
        pci_bus_id=bus_id,
        memory_total_mib=int(memory.group(1)),
        compute_capability=compute_cap,
        driver_version=optional("driver_version"),
    )


@dataclass(frozen=True)
class Topology:
    """Links between a node's GPUs, as `nvidia-smi topo -m` prints them.

    `links[(i, j)]` is the printed link type ("NV2", "PIX", "SYS", …) for every
    ordered pair of distinct GPUs. `gpus` lists the GPU indices; it matters for a
    one-GPU node, whose matrix has no pairs at all.
    """

    links: dict[tuple[int, int], str] = field(default_factory=dict)
    gpus: tuple[int, ...] = ()

    @property
    def indices(self) -> list[int]:
        known = set(self.gpus)
        for a, b in self.links:
            known.update((a, b))
        return sorted(known)

    def link(self, a: int, b: int) -> str:
        """The link type between GPU `a` and GPU `b`; "X" for a GPU with itself."""
        if a == b and a in self.indices:
            return "X"
        try:
            return self.links[(a, b)]
        except KeyError:
            raise KeyError(f"no link between GPU{a} and GPU{b} in this topology") from None

    def is_nvlink(self, a: int, b: int) -> bool:
        return a != b and bool(_NVLINK_RE.match(self.link(a, b)))

    def nvlink_peers(self, i: int) -> list[int]:
        return [j for j in self.indices if self.is_nvlink(i, j)]

    def nvlink_connected(self, indices: Iterable[int]) -> bool:
        """True when the GPUs form one connected graph over NVLink edges.

        Not every pair needs a direct link: on a DGX-1 hybrid cube-mesh NCCL builds
        its rings over NVLink through intermediate GPUs, so a TP group only needs to
        be reachable over NVLink. An empty group is not a group, hence False.
        """
        group = set(indices)
        unknown = group - set(self.indices)
        if unknown:
            raise KeyError(f"GPUs {sorted(unknown)} are not in this topology")
        if not group:
            return False
        start = min(group)
        reached = {start}
        frontier = [start]
        while frontier:
            current = frontier.pop()
            for peer in group - reached:
                if self.is_nvlink(current, peer):
                    reached.add(peer)
                    frontier.append(peer)
        return reached == group

    def interconnect_summary(self) -> str:
        """One word for the node: nvlink, pcie, or none when it has fewer than two GPUs."""
        if len(self.indices) < 2:
            return "none"
        if any(_NVLINK_RE.match(kind) for kind in self.links.values()):
            return "nvlink"
        return "pcie"


def parse_topology(text: str) -> Topology:
    """Parse the matrix `nvidia-smi topo -m` prints.

    Only the GPU-by-GPU block is kept: NIC rows and columns (NIC0… or mlx5_…), the
    affinity columns (CPU, NUMA, GPU NUMA ID) and the legends that follow the matrix
    are skipped. Terminal escapes (driver 580's underlined header) are removed first.
    """
    text = _ANSI_ESCAPE_RE.sub("", text)
    if not text.strip() or text.strip().startswith(_NO_DEVICES):
        return Topology()

    lines = text.splitlines()
    header_at = next((n for n, line in enumerate(lines) if _is_matrix_header(line.split())), None)
    if header_at is None:
        raise InputError(TOPO_SOURCE, "no matrix header (a line of column names starting with GPU0)")

    # Positions are counted in whitespace-split tokens. GPU columns come first, so
    # the multi-word headers after them ("CPU Affinity") cannot shift them.
    columns: dict[int, int] = {}
    for position, token in enumerate(lines[header_at].split()):
        label = _GPU_LABEL_RE.match(token)
        if label is None:
            continue
        gpu = int(label.group(1))
        if gpu in columns:
            raise InputError(TOPO_SOURCE, f"line {header_at + 1}: GPU{gpu} appears twice in the header")
        columns[gpu] = position

    links: dict[tuple[int, int], str] = {}
    rows: set[int] = set()
    for offset, line in enumerate(lines[header_at + 1 :], start=header_at + 2):
        tokens = line.split()
        if not tokens:
            continue
        if tokens[0].rstrip(":") == "Legend":
            break
        label = _GPU_LABEL_RE.match(tokens[0])
        if label is None:
            continue  # a NIC row
        gpu = int(label.group(1))
        if gpu not in columns:
            raise InputError(TOPO_SOURCE, f"line {offset}: GPU{gpu} has a row but no column")
        if gpu in rows:
            raise InputError(TOPO_SOURCE, f"line {offset}: GPU{gpu} has two rows")
        rows.add(gpu)
        cells = tokens[1:]
        for peer, position in columns.items():
            if position >= len(cells):
                raise InputError(TOPO_SOURCE, f"line {offset}: GPU{gpu} row ends before GPU{peer}")
            kind = cells[position]
            if not _LINK_RE.match(kind):
                raise InputError(
                    TOPO_SOURCE, f"line {offset}: GPU{gpu}-GPU{peer} link {kind!r} is not a link type"
                )
            if (kind == "X") != (peer == gpu):
                raise InputError(
                    TOPO_SOURCE,
                    f"line {offset}: GPU{gpu}-GPU{peer} is {kind!r}; X belongs on the diagonal only",
                )
            if peer != gpu:
                links[(gpu, peer)] = kind

    missing = sorted(set(columns) - rows)
    if missing:
        raise InputError(TOPO_SOURCE, f"no rows for {', '.join(f'GPU{gpu}' for gpu in missing)}")
    return Topology(links=links, gpus=tuple(sorted(columns)))


def _is_matrix_header(tokens: list[str]) -> bool:
    # nvidia-smi indents the header, but logs often lose leading whitespace; the
    # GPU0 row is told apart by the link type ("X") that follows its label.
    return tokens[:1] == ["GPU0"] and (len(tokens) == 1 or not _LINK_RE.match(tokens[1]))


Runner = Callable[..., subprocess.CompletedProcess[str]]


def discover_local(run: Runner = subprocess.run) -> tuple[list[GpuReading], Topology]:
    """The GPUs of this machine and their topology.

    A machine without nvidia-smi, or whose driver is not loaded, has no GPUs rather
    than an error: a CPU node may still serve the CPU build of vLLM.
    """
    query = _run_nvidia_smi(run, QUERY_COMMAND, QUERY_SOURCE)
    if query is None:
        return [], Topology()
    readings = parse_query_csv(query)
    if not readings:
        return [], Topology()
    topo = _run_nvidia_smi(run, TOPO_COMMAND, TOPO_SOURCE)
    if topo is None:
        return [], Topology()
    topology = parse_topology(topo)
    # Both commands number GPUs the same way; a mismatch means the GPU set changed
    # between the two runs (a GPU fell off the bus) and neither answer can be trusted.
    if topology.indices != sorted(reading.index for reading in readings):
        raise InputError(
            TOPO_SOURCE,
            f"lists GPUs {topology.indices} but the query lists {sorted(r.index for r in readings)}",
        )
    return readings, topology


def _run_nvidia_smi(run: Runner, argv: list[str], source: str) -> str | None:
    """stdout of the command, or None when this machine has no usable NVIDIA GPU."""
    try:
        result = run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False)
    except FileNotFoundError:
        return None
    except subprocess.TimeoutExpired:
        raise InputError(source, f"did not answer within {COMMAND_TIMEOUT_S} s") from None
    except OSError as error:
        raise InputError(source, f"could not be run: {error}") from None
    if result.returncode == 0:
        return result.stdout
    # nvidia-smi prints these on stdout, not stderr, so both streams are checked.
    output = f"{result.stdout or ''}\n{result.stderr or ''}"
    if _DRIVER_DOWN in output or _NO_DEVICES in output:
        return None
    first_line = next(
        (line.strip() for line in (result.stderr or result.stdout or "").splitlines() if line.strip()),
        "no output",
    )
    raise InputError(source, f"exited with status {result.returncode}: {first_line}")
