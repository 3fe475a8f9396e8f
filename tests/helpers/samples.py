"""Committed sample inputs: nvidia-smi outputs and the bundled model configs."""

from __future__ import annotations

import json

from inference.hf_config import known_configs
from tests.helpers import ROOT

NVIDIA_SMI = ROOT / "inference" / "data" / "nvidia_smi"
# Real outputs collected from public sources, each with its source URL on its first line.


def nvidia_smi_sample(name: str) -> str:
    return (NVIDIA_SMI / name).read_text()


def bundled_config(name: str) -> dict:
    return json.loads(known_configs()[name].read_text())
