"""Real nvidia-smi outputs collected from public sources (tests/fixtures/gpu/real/).

Each file's first line is a comment naming its source and what it is; the rest is the output
byte for byte. Odd inputs derived from a real one are built in the test that uses them, and
say so there.
"""

from __future__ import annotations

import subprocess

from tests.helpers import ROOT

REAL_GPU = ROOT / "tests" / "fixtures" / "gpu" / "real"


def real_gpu_output(name: str) -> str:
    """The output stored in `name`, without its source line."""
    with open(REAL_GPU / name, encoding="utf-8", newline="") as file:
        text = file.read()
    first, _, rest = text.partition("\n")
    assert first.startswith("#"), f"{name} lacks its source line"
    return rest


Answer = subprocess.CompletedProcess[str] | Exception


class ScriptedNvidiaSmi:
    """Stands in for subprocess.run on a machine without NVIDIA GPUs: answers each nvidia-smi
    command line from a table (real outputs), as `inference.nvidia_smi.discover` would see them."""

    def __init__(self, answers: dict[tuple[str, ...], Answer]) -> None:
        self.answers = answers
        self.asked: list[tuple[str, ...]] = []

    def __call__(self, argv: list[str], **_kwargs: object) -> subprocess.CompletedProcess[str]:
        self.asked.append(tuple(argv))
        answer = self.answers[tuple(argv)]
        if isinstance(answer, Exception):
            raise answer
        return answer


def answered(argv: list[str], returncode: int = 0, stdout: str = "", stderr: str = "") -> Answer:
    return subprocess.CompletedProcess(argv, returncode, stdout=stdout, stderr=stderr)
