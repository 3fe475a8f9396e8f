"""Fake vLLM install trees for the environment probe: real files a real Python imports.

`fatbin_elf` builds a small but well-formed 64-bit ELF shared object whose `.nv_fatbin` section
is laid out as nvcc lays it out (a fatbinary header, then one entry per cubin or PTX with its SM
number at byte 28 of the entry header), so the probe reads it as it reads vLLM's `_C.abi3.so`.
"""

from __future__ import annotations

import stat
import struct
import sys
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50


def fatbin(archs: list[str]) -> bytes:
    """A fatbinary with one entry per `sm_XY` (ELF cubin) or `compute_XY` (PTX), each with a stub payload."""
    entries = b""
    for arch in archs:
        kind = 2 if arch.startswith("sm_") else 1
        number = int(arch.split("_")[1])
        payload = b"\0" * 16
        header = bytearray(64)
        struct.pack_into("<HHIQ", header, 0, kind, 0x0101, len(header), len(payload))
        struct.pack_into("<I", header, 28, number)
        entries += bytes(header) + payload
    return struct.pack("<IHHQ", FATBIN_MAGIC, 1, 16, len(entries)) + entries


def fatbin_elf(archs: list[str]) -> bytes:
    """An ELF64 little-endian shared object with sections: null, .shstrtab, .text, .nv_fatbin."""
    names = b"\0.shstrtab\0.text\0.nv_fatbin\0"
    text = b"\xc3" * 16  # ret: the object has some code, as a real one does
    fat = fatbin(archs)
    body_at = 64
    layout = [(names, 1), (text, names.index(b".text")), (fat, names.index(b".nv_fatbin"))]
    body, offsets = b"", []
    for data, _ in layout:
        while (body_at + len(body)) % 8:
            body += b"\0"
        offsets.append(body_at + len(body))
        body += data
    while (body_at + len(body)) % 8:
        body += b"\0"
    shoff = body_at + len(body)
    sections = bytes(64)  # the null section
    for (data, name_offset), offset in zip(layout, offsets, strict=True):
        kind = 3 if name_offset == 1 else 1  # SHT_STRTAB, SHT_PROGBITS
        sections += struct.pack("<IIQQQQIIQQ", name_offset, kind, 0, 0, offset, len(data), 0, 0, 8, 0)
    ident = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    header = ident + struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, shoff, 0, 64, 0, 0, 64, len(layout) + 1, 1)
    return header + body + sections


def fake_vllm_install(
    root: Path,
    *,
    vllm_version: str,
    kernel_archs: list[str],
    torch_version: str = "2.10.0+cu126",
    torch_cuda: str = "12.6",
    torch_archs: tuple[str, ...] = ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"),
) -> Path:
    """A site-packages with a `vllm` (metadata and a `_C.abi3.so`) and a `torch` stub; returns its python.

    The python is a wrapper that runs this interpreter with that site-packages first on the path.
    """
    site = root / "site-packages"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    (site / "vllm" / "_C.abi3.so").write_bytes(fatbin_elf(kernel_archs))
    dist = site / f"vllm-{vllm_version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {vllm_version}\n")
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text(
        f"__version__ = {torch_version!r}\n"
        f"class version:\n    cuda = {torch_cuda!r}\n"
        f"class cuda:\n    @staticmethod\n    def get_arch_list():\n        return {list(torch_archs)!r}\n"
    )
    python = root / "bin" / "python"
    python.parent.mkdir()
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{site}" exec "{sys.executable}" "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return python
