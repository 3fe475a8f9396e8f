"""Which GPUs a list of compiled CUDA architectures can run on (CUDA's compatibility rules).

An arch list is torch's (`torch.cuda.get_arch_list()`) or one read from a vLLM library's fatbinary
(inference/env_probe.py); a wheel's list is in its engine line (inference/engines.py).
"""

from __future__ import annotations

import re


def sm_name(compute_capability: str) -> str:
    """ "7.0" → "sm_70"."""
    major, _, minor = compute_capability.partition(".")
    return f"sm_{major}{minor or '0'}"


def missing_kernels(arch_list: list[str], compute_capabilities: list[str]) -> list[str]:
    """The `sm_XY` of the given GPUs that an arch list (torch's, or one of vLLM's libraries) lacks.

    A cubin runs on GPUs of its major version and the same or a higher minor (an `sm_80` cubin
    on an sm_86 A10), and a PTX entry (`compute_XY`) at or below a GPU's capability can JIT for
    it (CUDA's compatibility rules), so such GPUs are not reported.
    """
    cubins: list[int] = []
    ptx: list[int] = []
    for arch in arch_list:
        match = re.match(r"^(sm|compute)_(\d+)", arch)
        if match:
            (cubins if match[1] == "sm" else ptx).append(int(match[2]))
    missing = []
    for cc in sorted(set(compute_capabilities)):
        name = sm_name(cc)
        number = int(name.removeprefix("sm_"))
        runs = any(c // 10 == number // 10 and c <= number for c in cubins) or any(p <= number for p in ptx)
        if not runs:
            missing.append(name)
    return missing


def missing_vllm_kernels(kernel_archs: dict[str, list[str]], compute_capabilities: list[str]) -> list[str]:
    """The `sm_XY` of the given GPUs that any of vLLM's compiled ops lacks (a CPU build has none)."""
    missing: set[str] = set()
    for archs in kernel_archs.values():
        missing.update(missing_kernels(archs, compute_capabilities))
    return sorted(missing)
