"""What GPUs a node has and how they are wired, read from `nvidia-smi`.

A node agent runs `QUERY_COMMAND` and `TOPO_COMMAND` (or `discover_local` does it)
and the portal parses the text here into `GpuReading`s and a `Topology`. The planner
uses the topology to keep a tensor-parallel group on NVLink: over PCIe 3.0 the
all-reduce of every layer makes TP slow (docs/v100-field-guide.md#hardware).
"""

from __future__ import annotations

import csv
import enum
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
# Drivers of the 470 branch print this (exit status 2) for a field they do not know, such as
# compute_cap (canonical/inference-snaps#89, tests/fixtures/gpu/real/query-r470-*.txt).
_UNKNOWN_FIELD_RE = re.compile(r'Field "([^"]+)" is not a valid field to query')
_BOM = "\ufeff"

_MEMORY_RE = re.compile(r"^(\d+)(?:\s*MiB)?$")
_COMPUTE_CAP_RE = re.compile(r"^\d+\.\d+$")
_BUS_ID_RE = re.compile(r"^[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]$")
_UNIT_SUFFIX_RE = re.compile(r"\s*\[[^\]]*\]$")

_GPU_LABEL_RE = re.compile(r"^GPU(\d+)$")
# SOC is what drivers before the SYS/NODE split printed for a cross-socket path.
_LINK_RE = re.compile(r"^(X|NV\d+|PIX|PXB|PHB|NODE|SYS|SOC)$")
_NVLINK_RE = re.compile(r"^NV(\d+)$")
# The columns nvidia-smi prints after the device columns, as the header spells them.
AFFINITY_COLUMNS = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
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


@dataclass(frozen=True)
class RowProblem:
    """One row of the query output that could not be read; it costs only its own GPU."""

    line: int
    index: int | None  # the GPU the row describes, when at least its index could be read
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


@dataclass(frozen=True)
class QueryReport:
    """What a `--query-gpu` answer says: the GPUs read, the rows that could not be, and why the
    driver answered nothing (`no_answer`, "" when it answered)."""

    readings: tuple[GpuReading, ...] = ()
    problems: tuple[RowProblem, ...] = ()
    no_answer: str = ""


class _RowError(Exception):
    def __init__(self, message: str, index: int | None) -> None:
        super().__init__(message)
        self.message = message
        self.index = index


def read_query_csv(text: str) -> QueryReport:
    """Parse `QUERY_COMMAND` output row by row, with or without header and units.

    With a header the columns are found by name, wherever `index` is and whatever other
    columns there are (a UTF-8 byte-order mark is ignored); without one they must be in
    `QUERY_FIELDS` order. A row that cannot be read (a bracketed driver token where a value
    belongs, too few or too many values, a duplicate index) is a `RowProblem` and costs only
    its own GPU. Only a header without the required columns refuses the whole text.
    """
    text = text.replace(_BOM, "")
    stripped = text.strip()
    if not stripped:
        return QueryReport(no_answer="nvidia-smi printed nothing")
    if stripped.startswith(_NO_DEVICES) or _DRIVER_DOWN in stripped:
        return QueryReport(no_answer=stripped.splitlines()[0].strip())

    columns: list[str] | None = None
    readings: list[GpuReading] = []
    problems: list[RowProblem] = []
    seen: set[int] = set()
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        cells = [cell.strip() for cell in next(csv.reader([line], skipinitialspace=True))]
        if columns is None:
            columns = _read_header(cells, number)
            if columns is not None:
                continue
            if not cells[0].isdigit():
                # A line before the header or the first row (a driver warning such as "WARNING:
                # infoROM is corrupted at gpu …"): no GPU's row, but said, not dropped.
                problems.append(RowProblem(number, None, f"not a GPU row: {line.strip()[:100]!r}"))
                continue
            columns = list(QUERY_FIELDS)
        try:
            reading = _read_row(columns, cells, number)
        except _RowError as error:
            problems.append(RowProblem(number, error.index, error.message))
            continue
        if reading.index in seen:
            problems.append(RowProblem(number, reading.index, f"GPU index {reading.index} appears twice"))
            continue
        seen.add(reading.index)
        readings.append(reading)
    return QueryReport(readings=tuple(readings), problems=tuple(problems))


def parse_query_csv(text: str) -> list[GpuReading]:
    """`read_query_csv`, strictly: the first unreadable row refuses the text (a pasted output,
    which the operator can fix, rather than a node's live answer)."""
    report = read_query_csv(text)
    if _DRIVER_DOWN in report.no_answer:
        raise InputError(QUERY_SOURCE, report.no_answer)
    if report.problems:
        raise InputError(QUERY_SOURCE, str(report.problems[0]))
    return list(report.readings)


def _read_header(cells: list[str], number: int) -> list[str] | None:
    """Column names if `cells` is a header line, else None (a `noheader` data row)."""
    names = [_UNIT_SUFFIX_RE.sub("", cell) for cell in cells]
    if not any(name in QUERY_FIELDS for name in names):
        return None
    missing = [name for name in QUERY_FIELDS if name not in names and name not in _OPTIONAL_FIELDS]
    if missing:
        raise InputError(QUERY_SOURCE, f"line {number}: header lacks {', '.join(missing)}")
    return names


def _read_row(columns: list[str], cells: list[str], number: int) -> GpuReading:
    position = columns.index("index")
    index_cell = cells[position] if position < len(cells) else ""
    index = int(index_cell) if index_cell.isdigit() else None
    if len(cells) != len(columns):
        raise _RowError(f"expected {len(columns)} values, found {len(cells)}", index)
    row = dict(zip(columns, cells, strict=True))

    def required(name: str) -> str:
        value = row[name]
        if not value or value in _MISSING_VALUES or value.startswith("["):
            # A bracketed token ("[GPU requires reset]", "[Unknown Error]") says why there is no value.
            raise _RowError(f"{name} is missing ({value or 'empty'})", index)
        return value

    def optional(name: str) -> str | None:
        value = row.get(name, "")
        return None if not value or value in _MISSING_VALUES or value.startswith("[") else value

    if index is None:
        raise _RowError(f"index {index_cell!r} is not a number", None)
    memory = _MEMORY_RE.match(required("memory.total"))
    if memory is None:
        raise _RowError(f"memory.total {row['memory.total']!r} is not a MiB count", index)
    bus_id = required("pci.bus_id")
    if not _BUS_ID_RE.match(bus_id):
        raise _RowError(f"pci.bus_id {bus_id!r} is not a PCI address", index)
    compute_cap = optional("compute_cap")
    if compute_cap is not None and not _COMPUTE_CAP_RE.match(compute_cap):
        compute_cap = None  # unknown for this field only: the catalog knows the model's
    return GpuReading(
        index=index,
        name=required("name"),
        uuid=required("uuid"),
        pci_bus_id=bus_id,
        memory_total_mib=int(memory.group(1)),
        compute_capability=compute_cap,
        driver_version=optional("driver_version"),
    )


class LinkKind(enum.StrEnum):
    """What a `topo -m` cell says about the path between two GPUs, best first.

    The legend nvidia-smi prints under the matrix defines them: NV# a bonded set of # NVLinks;
    PIX at most one PCIe bridge and PXB several (both peer-to-peer capable without the CPU);
    PHB through a PCIe host bridge (the CPU); NODE between host bridges of one NUMA node; SYS
    across the SMP interconnect between NUMA nodes (SOC before the SYS/NODE split). Anything
    else (`CNS`, `N/A`, a token of a later driver) is unknown for that pair only.
    """

    NVLINK = "nvlink"
    PIX = "pix"
    PXB = "pxb"
    PHB = "phb"
    NODE = "node"
    SYS = "sys"
    UNKNOWN = "unknown"


_KIND_OF_TOKEN = {
    "PIX": LinkKind.PIX,
    "PXB": LinkKind.PXB,
    "PHB": LinkKind.PHB,
    "NODE": LinkKind.NODE,
    "SYS": LinkKind.SYS,
    "SOC": LinkKind.SYS,
}

# For ranking a TP2 pair: NVLink, then the PCIe-switch paths (P2P without the CPU), then the
# host-bridge paths of one socket, then cross-socket; unknown is ranked last.
LINK_RANK = {
    LinkKind.NVLINK: 0,
    LinkKind.PIX: 1,
    LinkKind.PXB: 1,
    LinkKind.PHB: 2,
    LinkKind.NODE: 2,
    LinkKind.SYS: 3,
    LinkKind.UNKNOWN: 4,
}


def link_kind_of(token: str) -> LinkKind:
    if _NVLINK_RE.match(token):
        return LinkKind.NVLINK
    return _KIND_OF_TOKEN.get(token, LinkKind.UNKNOWN)


@dataclass(frozen=True)
class Topology:
    """Links between a node's GPUs, as `nvidia-smi topo -m` prints them.

    `links[(i, j)]` is the printed link token ("NV2", "PIX", "SYS", "CNS", …) for every
    ordered pair of distinct GPUs. `gpus` lists the GPU indices; it matters for a
    one-GPU node, whose matrix has no pairs at all. `cpu_affinity`, `numa_affinity` and
    `gpu_numa_id` keep the affinity columns per GPU where the driver printed a value.
    """

    links: dict[tuple[int, int], str] = field(default_factory=dict)
    gpus: tuple[int, ...] = ()
    cpu_affinity: dict[int, str] = field(default_factory=dict)
    numa_affinity: dict[int, str] = field(default_factory=dict)
    gpu_numa_id: dict[int, str] = field(default_factory=dict)

    @property
    def indices(self) -> list[int]:
        known = set(self.gpus)
        for a, b in self.links:
            known.update((a, b))
        return sorted(known)

    def link(self, a: int, b: int) -> str:
        """The link token between GPU `a` and GPU `b`; "X" for a GPU with itself."""
        if a == b and a in self.indices:
            return "X"
        try:
            return self.links[(a, b)]
        except KeyError:
            raise KeyError(f"no link between GPU{a} and GPU{b} in this topology") from None

    def link_kind(self, a: int, b: int) -> LinkKind:
        return link_kind_of(self.link(a, b))

    def nvlink_count(self, a: int, b: int) -> int:
        """How many NVLinks are bonded between `a` and `b` (the # of NV#); 0 without NVLink."""
        match = _NVLINK_RE.match(self.link(a, b)) if a != b else None
        return int(match.group(1)) if match else 0

    def is_nvlink(self, a: int, b: int) -> bool:
        return a != b and bool(_NVLINK_RE.match(self.link(a, b)))

    def nvlink_peers(self, i: int) -> list[int]:
        return [j for j in self.indices if self.is_nvlink(i, j)]

    def socket(self, i: int) -> str | None:
        """The CPU side GPU `i` hangs off: its NUMA node where printed, else its CPU affinity."""
        return self.numa_affinity.get(i) or self.cpu_affinity.get(i)

    def nvlink_connected(self, indices: Iterable[int]) -> bool:
        """True when the GPUs form one connected graph over NVLink edges.

        Connected is not enough for a TP group of three or more, whose NCCL ring needs a
        cycle over NVLink (`inference.tp_topology.has_nvlink_ring`). An empty group is not
        a group, hence False.
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

    The GPU-by-GPU block and the affinity columns (CPU Affinity, NUMA Affinity, GPU NUMA ID)
    are kept; NIC rows and columns (NIC0… or mlx5_…) and the legends are skipped. Terminal
    escapes (driver 580's underlined header) are removed first. A link token this code does
    not know is kept as printed and is `LinkKind.UNKNOWN` for that pair only.
    """
    text = _ANSI_ESCAPE_RE.sub("", text).replace(_BOM, "")
    if not text.strip() or text.strip().startswith(_NO_DEVICES):
        return Topology()

    lines = text.splitlines()
    header_at = next((n for n, line in enumerate(lines) if _is_matrix_header(line.split())), None)
    if header_at is None:
        raise InputError(TOPO_SOURCE, "no matrix header (a line of column names starting with GPU0)")

    # Positions are counted in whitespace-split tokens. Device columns (GPUs, then NICs) come
    # first; the multi-word affinity headers follow them and are matched by name.
    header = lines[header_at].split()
    starts = ("CPU Affinity", "NUMA Affinity", "GPU NUMA")
    devices = next((n for n in range(len(header)) if " ".join(header[n : n + 2]) in starts), len(header))
    rest = " ".join(header[devices:])
    affinity_names = sorted((n for n in AFFINITY_COLUMNS if n in rest), key=rest.index)
    columns: dict[int, int] = {}
    for position, token in enumerate(header[:devices]):
        label = _GPU_LABEL_RE.match(token)
        if label is None:
            continue
        gpu = int(label.group(1))
        if gpu in columns:
            raise InputError(TOPO_SOURCE, f"line {header_at + 1}: GPU{gpu} appears twice in the header")
        columns[gpu] = position

    links: dict[tuple[int, int], str] = {}
    affinity: dict[str, dict[int, str]] = {name: {} for name in AFFINITY_COLUMNS}
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
            if (kind == "X") != (peer == gpu):
                raise InputError(
                    TOPO_SOURCE,
                    f"line {offset}: GPU{gpu}-GPU{peer} is {kind!r}; X belongs on the diagonal only",
                )
            if peer != gpu:
                links[(gpu, peer)] = kind
        for name, value in zip(affinity_names, cells[devices:], strict=False):
            if value not in _MISSING_VALUES:
                affinity[name][gpu] = value

    missing = sorted(set(columns) - rows)
    if missing:
        raise InputError(TOPO_SOURCE, f"no rows for {', '.join(f'GPU{gpu}' for gpu in missing)}")
    return Topology(
        links=links,
        gpus=tuple(sorted(columns)),
        cpu_affinity=affinity["CPU Affinity"],
        numa_affinity=affinity["NUMA Affinity"],
        gpu_numa_id=affinity["GPU NUMA ID"],
    )


def _is_matrix_header(tokens: list[str]) -> bool:
    # nvidia-smi indents the header, but logs often lose leading whitespace; the
    # GPU0 row is told apart by the link type ("X") that follows its label.
    return tokens[:1] == ["GPU0"] and (len(tokens) == 1 or not _LINK_RE.match(tokens[1]))


Runner = Callable[..., subprocess.CompletedProcess[str]]


@dataclass(frozen=True)
class Discovery:
    """What the node's driver said when asked for its GPUs and their topology.

    `no_answer` says why the driver listed no GPU at all ("NVIDIA-SMI has failed…", "No devices
    were found", what operators see right after an Xid 79): the portal then marks the node's
    GPUs lost rather than deleting them. `lacking_fields` are optional query fields this driver
    does not know (dropped, and asked again without them). `topology_error` says why the
    topology could not be read; the GPUs stand without it.
    """

    readings: tuple[GpuReading, ...] = ()
    topology: Topology = field(default_factory=Topology)
    topology_text: str = ""
    problems: tuple[RowProblem, ...] = ()
    lacking_fields: tuple[str, ...] = ()
    no_answer: str = ""
    topology_error: str = ""

    def notes(self) -> list[str]:
        """One line per thing an operator should know about this discovery."""
        notes = [f"{QUERY_SOURCE}: {problem}" for problem in self.problems]
        if self.lacking_fields:
            notes.append(
                f"this driver does not know {', '.join(self.lacking_fields)}; "
                "those facts come from the GPU catalog"
            )
        if self.no_answer:
            notes.append(f"the driver listed no GPUs: {self.no_answer}")
        if self.topology_error:
            notes.append(f"{TOPO_SOURCE}: {self.topology_error}")
        return notes


def query_command(fields: Iterable[str] = QUERY_FIELDS) -> list[str]:
    return ["nvidia-smi", "--query-gpu=" + ",".join(fields), "--format=csv"]


def discover(run: Runner = subprocess.run) -> Discovery:
    """Ask this machine's driver for its GPUs and their topology (the node agent's discovery).

    A field the driver does not know is dropped and the query asked again, when it is optional
    (`compute_cap` on the 470 branch); an unreadable row costs only its GPU; a topology that
    cannot be read leaves the GPUs without one. A machine without nvidia-smi has no GPUs.
    """
    fields = list(QUERY_FIELDS)
    lacking: list[str] = []
    while True:
        answer = _run_nvidia_smi(run, query_command(fields), QUERY_SOURCE)
        if answer.unknown_field is None:
            break
        if answer.unknown_field not in fields or answer.unknown_field not in _OPTIONAL_FIELDS:
            raise InputError(
                QUERY_SOURCE,
                f"this driver does not know the field {answer.unknown_field!r}, which discovery needs",
            )
        fields.remove(answer.unknown_field)
        lacking.append(answer.unknown_field)
    if answer.stdout is None:
        return Discovery(lacking_fields=tuple(lacking), no_answer=answer.no_answer)
    report = read_query_csv(answer.stdout)
    if not report.readings:
        no_answer = report.no_answer or ("" if report.problems else "nvidia-smi listed no GPUs")
        return Discovery(problems=report.problems, lacking_fields=tuple(lacking), no_answer=no_answer)
    found = sorted(reading.index for reading in report.readings)
    topology, topology_text, topology_error = Topology(gpus=tuple(found)), "", ""
    try:
        topo = _run_nvidia_smi(run, TOPO_COMMAND, TOPO_SOURCE)
        if topo.stdout is None:
            topology_error = topo.no_answer or "no answer"
        else:
            topology_text = topo.stdout
            parsed = parse_topology(topo.stdout)
            # Both commands number GPUs the same way; unreadable query rows are in the matrix
            # too, but a GPU read by the query and absent from the matrix means the GPU set
            # changed between the two runs (a GPU fell off the bus): the links cannot be trusted.
            if not set(found) <= set(parsed.indices):
                raise InputError(TOPO_SOURCE, f"lists GPUs {parsed.indices} but the query lists {found}")
            topology = parsed
    except InputError as error:
        topology_error = error.message
    return Discovery(
        readings=report.readings,
        topology=topology,
        topology_text=topology_text,
        problems=report.problems,
        lacking_fields=tuple(lacking),
        topology_error=topology_error,
    )


def discover_local(run: Runner = subprocess.run) -> tuple[list[GpuReading], Topology]:
    """The GPUs of this machine and their topology (`discover`, as a pair).

    A machine without nvidia-smi, or whose driver is not loaded, has no GPUs rather
    than an error: a CPU node may still serve the CPU build of vLLM. A topology that
    cannot be read is an `InputError` here.
    """
    found = discover(run)
    if found.topology_error:
        raise InputError(TOPO_SOURCE, found.topology_error)
    return list(found.readings), found.topology


@dataclass(frozen=True)
class _Answer:
    stdout: str | None  # None: the driver answered nothing usable
    no_answer: str = ""
    unknown_field: str | None = None


def _run_nvidia_smi(run: Runner, argv: list[str], source: str) -> _Answer:
    """The command's stdout, or why this machine has no usable NVIDIA GPU."""
    try:
        result = run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False)
    except FileNotFoundError:
        return _Answer(None, "nvidia-smi is not installed")
    except subprocess.TimeoutExpired:
        raise InputError(source, f"did not answer within {COMMAND_TIMEOUT_S} s") from None
    except OSError as error:
        raise InputError(source, f"could not be run: {error}") from None
    if result.returncode == 0:
        return _Answer(result.stdout)
    # nvidia-smi prints these on stdout, not stderr, so both streams are checked.
    output = f"{result.stdout or ''}\n{result.stderr or ''}"
    unknown = _UNKNOWN_FIELD_RE.search(output)
    if unknown is not None:
        return _Answer(None, unknown_field=unknown.group(1))
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    if _DRIVER_DOWN in output or _NO_DEVICES in output:
        said = next(line for line in lines if _DRIVER_DOWN in line or _NO_DEVICES in line)
        return _Answer(None, said)
    first_line = next(
        (line.strip() for line in (result.stderr or result.stdout or "").splitlines() if line.strip()),
        "no output",
    )
    raise InputError(source, f"exited with status {result.returncode}: {first_line}")
