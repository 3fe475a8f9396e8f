"""Which GPUs of a node make a good tensor-parallel group, read from its `nvidia-smi topo -m`.

vLLM's tensor parallelism all-reduces every layer through NCCL, which moves the data around a
ring over the group. A ring of three or more GPUs stays on NVLink only when the NVLink links
contain a cycle through every GPU of the group (a Hamiltonian cycle); being connected over
NVLink is not enough. On a DGX-1 hybrid cube-mesh (8x V100 SXM2) 56 of the 70 four-GPU groups
are NVLink-connected, yet only 8 have an NVLink ring and only {0,1,2,3} and {4,5,6,7} are a
full NVLink mesh: `{0,1,2,4}` sends every all-reduce over a cross-socket hop. A pair is judged
by its one link: NVLink, then PIX/PXB (peer to peer through PCIe switches), then PHB/NODE
(through the CPU's host bridges), then SYS (across sockets). docs/gpu-topology.md has the rules.

`advise_tp_group` is the one call for "advise this TP group"; `best_tp_group` picks a group.
The cycle search is a plain backtracking over at most 8 (or 16) GPUs: networkx is not a
dependency, and its Hamiltonian helpers target tournaments only (docs/decisions.md).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

from inference.nvidia_smi import LINK_RANK, LinkKind, Topology
from inference.rules import Finding

# Findings name at most this many alternative groups (an 8-GPU node has at most 70 of a size).
MAX_GROUPS_NAMED = 6
# Groups are enumerated exhaustively; C(16, 8) = 12870 is the largest case on a 16-GPU node.
MAX_GPUS_SEARCHED = 16

# A TP group's sort key (`group_rank`): no ring, no mesh, several sockets, worst link, -bonded, indices.
GroupRank = tuple[bool, bool, bool, int, int, tuple[int, ...]]


class _Links:
    """The topology's pairs read once (kinds, NVLink neighbours, bonded links, sockets), so that
    ranking every group of a 16-GPU node does not parse the same tokens thousands of times."""

    def __init__(self, topology: Topology) -> None:
        gpus = topology.indices
        self.kind = {(a, b): topology.link_kind(a, b) for a in gpus for b in gpus if a != b}
        self.bonded = {pair: topology.nvlink_count(*pair) for pair in self.kind}
        self.nv = {a: {b for b in gpus if b != a and self.kind[(a, b)] == LinkKind.NVLINK} for a in gpus}
        self.socket = {a: topology.socket(a) for a in gpus}

    def mesh(self, group: Sequence[int]) -> bool:
        return all(b in self.nv[a] for a, b in itertools.combinations(group, 2))

    def ring(self, group: Sequence[int]) -> bool:
        group = list(dict.fromkeys(group))
        if len(group) < 2:
            return True
        if len(group) == 2:
            return group[1] in self.nv[group[0]]
        if self.mesh(group):
            return True
        members = set(group)
        if any(len(self.nv[g] & members) < 2 for g in group):
            return False  # a ring enters and leaves every GPU over two NVLink neighbours
        start = group[0]

        def extend(end: int, left: frozenset[int]) -> bool:
            if not left:
                return start in self.nv[end]
            return any(extend(nxt, left - {nxt}) for nxt in sorted(self.nv[end] & left))

        return extend(start, frozenset(group[1:]))

    def sockets(self, group: Iterable[int]) -> set[str]:
        return {s for g in group if (s := self.socket[g]) is not None}

    def worst(self, group: Sequence[int]) -> LinkKind:
        pairs = list(itertools.combinations(group, 2))
        if not pairs:
            return LinkKind.NVLINK
        return max((self.kind[pair] for pair in pairs), key=LINK_RANK.__getitem__)

    def rank(self, group: Sequence[int]) -> GroupRank:
        bonded = sum(self.bonded[pair] for pair in itertools.combinations(group, 2))
        return (
            not self.ring(group),
            not self.mesh(group),
            len(self.sockets(group)) > 1,
            LINK_RANK[self.worst(group)],
            -bonded,
            tuple(sorted(group)),
        )


def has_nvlink_ring(topology: Topology, gpus: Sequence[int]) -> bool:
    """True when NCCL can keep a ring through every GPU of the group on NVLink links.

    One GPU needs no ring; two need a direct NVLink; three or more need a Hamiltonian cycle
    over the NVLink links among themselves (links through GPUs outside the group do not count:
    a ring passes only through its members).
    """
    return _Links(topology).ring(gpus)


def is_nvlink_mesh(topology: Topology, gpus: Sequence[int]) -> bool:
    """True when every pair of the group has a direct NVLink (a full mesh, or an NVSwitch)."""
    return _Links(topology).mesh(gpus)


def sockets(topology: Topology, gpus: Iterable[int]) -> set[str]:
    """The CPU sockets (NUMA nodes, else CPU affinity sets) the group hangs off; empty if unknown."""
    return {s for gpu in gpus if (s := topology.socket(gpu)) is not None}


def worst_link(topology: Topology, gpus: Sequence[int]) -> LinkKind:
    return _Links(topology).worst(gpus)


def group_rank(topology: Topology, gpus: Sequence[int]) -> GroupRank:
    """Sort key of a TP group, best first: an NVLink ring, a full mesh, one socket, the best
    worst link, the most NVLinks bonded, then the lowest indices."""
    return _Links(topology).rank(gpus)


def ranked_groups(topology: Topology, size: int, among: Iterable[int] | None = None) -> list[tuple[int, ...]]:
    """Every group of `size` GPUs (of `among`, else of the node), best first by `group_rank`."""
    pool = sorted(set(topology.indices if among is None else among) & set(topology.indices))
    if size < 1 or size > len(pool) or len(pool) > MAX_GPUS_SEARCHED:
        return []
    links = _Links(topology)
    return sorted(itertools.combinations(pool, size), key=links.rank)


def best_tp_group(
    topology: Topology, size: int, among: Iterable[int] | None = None
) -> tuple[int, ...] | None:
    """The best group of `size` GPUs among `among` (all the node's by default); None if too few."""
    groups = ranked_groups(topology, size, among)
    return groups[0] if groups else None


def _named(groups: Iterable[tuple[int, ...]]) -> str:
    listed = list(groups)
    text = ", ".join("{" + ",".join(map(str, group)) + "}" for group in listed[:MAX_GROUPS_NAMED])
    more = len(listed) - MAX_GROUPS_NAMED
    return text + (f" and {more} more" if more > 0 else "")


def _group_text(gpus: Sequence[int]) -> str:
    return "{" + ",".join(map(str, gpus)) + "}"


def advise_tp_group(topology: Topology, gpus: Sequence[int]) -> list[Finding]:
    """What the topology says about running one tensor-parallel group on `gpus` (pure).

    Warnings: a group of three or more without an NVLink ring (naming the groups of the same
    size that have one, full meshes first), a pair without NVLink (naming the NVLink pairs, or
    the better PCIe pairs), a group whose ring leaves NVLink and spans CPU sockets, a link this
    code cannot read. Info: a ring that is not a full mesh where a mesh exists, and a group on
    NVLink that spans sockets (only host-side traffic crosses). A group of one gets nothing.
    """
    group = list(dict.fromkeys(gpus))
    if len(group) < 2:
        return []
    unknown = sorted(set(group) - set(topology.indices))
    if unknown:
        return [
            Finding(
                "warning",
                "tp_topology_unknown",
                f"GPUs {unknown} are not in this node's topology (nvidia-smi topo -m); "
                "the tensor-parallel group cannot be judged: discover the node again.",
            )
        ]
    findings: list[Finding] = []
    links = _Links(topology)
    size, text = len(group), _group_text(group)
    ranked: list[tuple[int, ...]] = []

    def others() -> list[tuple[int, ...]]:
        # The other groups of this size, best first; ranked only when a finding names them (a
        # 16-GPU node has 12,870 groups of 8).
        if not ranked:
            ranked.extend(g for g in ranked_groups(topology, size) if set(g) != set(group))
        return ranked

    ring = links.ring(group)
    spans = len(links.sockets(group)) > 1
    unreadable = [
        (a, b) for a, b in itertools.combinations(group, 2) if topology.link_kind(a, b) == LinkKind.UNKNOWN
    ]
    if unreadable:
        pairs = ", ".join(f"GPU{a}-GPU{b} ({topology.link(a, b)})" for a, b in unreadable)
        findings.append(
            Finding(
                "warning",
                "tp_link_unknown",
                f"the link type of {pairs} is not one nvidia-smi documents; the group is judged as if "
                "those pairs had no NVLink. Check `nvidia-smi topo -m` on the node.",
            )
        )
    if size == 2:
        kind = topology.link_kind(*group)
        if kind != LinkKind.NVLINK:
            better = [g for g in others() if LINK_RANK[links.worst(g)] < LINK_RANK[kind]]
            where = {
                LinkKind.PIX: "through a PCIe switch (peer to peer, but ~16 GB/s on PCIe 3.0)",
                LinkKind.PXB: "through PCIe switches (peer to peer, but ~16 GB/s on PCIe 3.0)",
                LinkKind.PHB: "through the CPU's PCIe host bridge",
                LinkKind.NODE: "between PCIe host bridges of one CPU",
                LinkKind.SYS: "across CPU sockets (the slowest path)",
                LinkKind.UNKNOWN: "over a path nvidia-smi does not name",
            }[kind]
            advice = f"; better pairs here: {_named(better)}" if better else ""
            findings.append(
                Finding(
                    "warning",
                    "tp_pair_without_nvlink",
                    f"GPUs {text} are linked {where} ({topology.link(*group)}), not by NVLink: every "
                    f"layer's all-reduce takes that path{advice}.",
                )
            )
    elif not ring:
        good = [g for g in others() if links.ring(g)]
        advice = (
            f" Groups of {size} here that keep the ring on NVLink: {_named(good)}."
            if good
            else f" No group of {size} GPUs on this node has an NVLink ring; prefer smaller "
            "tensor-parallel groups (or one instance per GPU)."
        )
        findings.append(
            Finding(
                "warning",
                "tp_no_nvlink_ring",
                f"GPUs {text} cannot keep their NCCL ring on NVLink (no cycle through all {size} over "
                f"NV# links), so every all-reduce crosses a PCIe or cross-socket hop.{advice}",
            )
        )
    elif not links.mesh(group):
        meshes = [g for g in others() if links.mesh(g)]
        if meshes:
            findings.append(
                Finding(
                    "info",
                    "tp_ring_not_mesh",
                    f"GPUs {text} keep an NVLink ring but are not a full NVLink mesh; a full mesh of "
                    f"{size} here: {_named(meshes)}.",
                )
            )
    if spans:
        on_nvlink = ring if size > 2 else topology.link_kind(*group) == LinkKind.NVLINK
        one_socket = [g for g in others() if len(links.sockets(g)) == 1]
        if on_nvlink:  # then only a one-socket group that keeps its NVLink ring is better
            one_socket = [g for g in one_socket if links.ring(g)]
        advice = f" One-socket groups of {size}: {_named(one_socket)}." if one_socket else ""
        findings.append(
            Finding(
                "info" if on_nvlink else "warning",
                "tp_spans_sockets",
                f"GPUs {text} hang off {len(links.sockets(group))} CPU sockets "
                f"({'; '.join(sorted(links.sockets(group)))}, from nvidia-smi's NUMA or CPU "
                "affinity); host-side work crosses between them." + advice,
            )
        )
    return findings
