"""What the node gives a server: the Python (with the GPUs' kernels), the model files (checked
against the release hashes), the addresses it binds and is reached at, and its port."""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Iterable
from pathlib import Path

from django.conf import settings

from inference import supervisor
from inference.cuda_archs import missing_kernels, missing_vllm_kernels, sm_name
from inference.env_probe import build_advice
from inference.errors import InputError
from inference.hashing import compare_hashes, hash_model_dir
from portal.core.errors import ApplicationError
from portal.inventory.models import Gpu, Node
from portal.inventory.services import node_probe_software

from ..models import Deployment
from .steps import StepFailed


def environment_check(deployment: Deployment, engine: str, gpus: list[Gpu]) -> tuple[str, str]:
    """The Python to launch with, after checking the node's torch build has the GPUs' kernels."""
    node = deployment.placed_node
    if engine == "sim":
        return sys.executable, "simulator: the portal's own Python; no GPU kernels run, no torch check"
    python = node.vllm_python
    if not python:
        raise StepFailed(
            "environment", f"node {node.name} has no vLLM environment (set vllm_python)", "no_env"
        )
    if not Path(python).exists():
        raise StepFailed("environment", f"{python} does not exist on node {node.name}", "no_env")
    if node.software_python != python or node.software_error or not node.software_probed_at:
        try:
            node_probe_software(node=node)
        except ApplicationError as error:
            raise StepFailed("environment", error.message, "no_env") from error
    facts = f"vLLM {node.vllm_version}, torch {node.torch_version}"
    if not gpus:
        return python, f"{facts}; CPU node: no GPU kernel check"
    if not node.torch_cuda_version:
        raise StepFailed(
            "environment", f"{facts} is a CPU build, but the deployment runs on GPUs", "no_kernel_image"
        )
    problem = kernel_problem(node, [g.compute_capability for g in gpus])
    if problem:
        raise StepFailed(
            "environment", f"{problem} for {gpus[0].name}: {problem_advice(node, gpus)}", "no_kernel_image"
        )
    return python, f"{facts}, CUDA {node.torch_cuda_version}; kernels for {sm_list(gpus)} present"


def kernel_problem(node: Node, compute_capabilities: list[str]) -> str:
    """Which of torch's kernels or vLLM's own compiled ops lack these GPUs' sm_XY ("" if none).

    Both are needed: torch's for its tensor ops, vLLM's (`_C*.so`) for attention, cache and
    quantization; a wheel can carry a torch with sm_70 and ops without it.
    """
    problems = []
    missing = missing_kernels(node.torch_arch_list, compute_capabilities)
    if missing:
        problems.append(
            f"torch {node.torch_version} (CUDA {node.torch_cuda_version}) has no {', '.join(missing)} kernels"
        )
    for library, archs in sorted(node.vllm_kernel_archs.items()):
        lacking = missing_kernels(archs, compute_capabilities)
        if lacking:
            problems.append(f"vLLM {node.vllm_version}'s {library} has no {', '.join(lacking)} kernels")
    return "; ".join(problems)


def problem_advice(node: Node, gpus: list[Gpu]) -> str:
    ccs = [g.compute_capability for g in gpus]
    missing = sorted(
        set(missing_kernels(node.torch_arch_list, ccs))
        | set(missing_vllm_kernels(node.vllm_kernel_archs, ccs))
    )
    return build_advice(missing)


def sm_list(gpus: Iterable[Gpu]) -> str:
    return ", ".join(sorted({sm_name(g.compute_capability) for g in gpus}))


def model_dir_check(deployment: Deployment, engine: str, run_dir: Path, has_files: bool) -> tuple[Path, str]:
    """The directory to pass as --model, after checking its files against the release hashes."""
    version = deployment.model_version
    simulated_release = engine == "sim" and version.simulated_release_at and not version.weights_sha256
    if not has_files or simulated_release:
        if engine == "sim":
            # The simulator needs only the architecture: give it the stored config.json.
            (run_dir / "config.json").write_text(json.dumps(version.config, indent=2))
            if has_files:
                return run_dir, "release-checked for simulated nodes only: the simulator reads config.json"
            return run_dir, "no model files on this node: the simulator reads the stored config.json"
        where = version.path or "(no path recorded)"
        raise StepFailed(
            "hashes", f"model directory {where} not found on node {deployment.placed_node.name}", "no_model"
        )
    if not version.weights_sha256:
        raise StepFailed(
            "hashes",
            f"{version.name} has no release hashes: record them first "
            f"(manage.py hash_model {version.path} --model {version.name})",
            "no_hashes",
        )
    try:
        actual = hash_model_dir(version.path)
    except InputError as error:
        raise StepFailed("hashes", f"model files: {error.message}", "model_files") from error
    expected = {
        "weights_sha256": version.weights_sha256,
        "tokenizer_sha256": version.tokenizer_sha256,
        "weight_files": version.weight_files,
        "tokenizer_files": version.tokenizer_files,
    }
    problems = compare_hashes(expected, actual)
    if problems:
        raise StepFailed(
            "hashes", "refused: files differ from the release: " + "; ".join(problems), "hash_mismatch"
        )
    count = len(actual.weight_files) + len(actual.tokenizer_files)
    return Path(version.path), f"{count} files match the release ({actual.weights_sha256[:12]})"


def server_hosts(node: Node) -> tuple[str, str]:
    """(address the server binds, address the gateway reaches it at): the same one, the node
    record's. Binding every interface (0.0.0.0) exposed the server beyond what the record says, and
    checking it on 127.0.0.1 showed it healthy while the gateway could not reach it (issue 37)."""
    host = node.hostname or "127.0.0.1"
    if host == "localhost":
        return "127.0.0.1", "127.0.0.1"
    return host, host


def address_check(node: Node) -> str:
    """The node's address resolved here, as the gateway will need it to be; StepFailed names the
    record to fix where it does not resolve."""
    _, host = server_hosts(node)
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise StepFailed(
            "address",
            f"the node's hostname {host!r} does not resolve ({error.strerror or error}): the gateway "
            "reaches the server at that name, so it could not either; fix the node's hostname",
            "unreachable",
        ) from None
    addresses = sorted({str(info[4][0]) for info in found})
    return f"the gateway reaches the server at {host}" + (
        f" ({', '.join(addresses)})" if addresses != [host] else ""
    )


def port_choose(deployment: Deployment, bind_host: str) -> tuple[int, str]:
    """Keep the deployment's port across restarts (the gateway's URL stays), unless it is taken."""
    previous = deployment.port
    if previous and supervisor.wait_port_free(bind_host, previous, timeout_s=3):
        return previous, f"{previous} (as before)"
    port = supervisor.find_free_port(bind_host)
    if previous:
        return port, f"{previous} is taken by another process; using {port}"
    return port, f"{port} (free)"


def local_url(deployment: Deployment) -> str:
    """Where the agent checks the server: the address the gateway uses, so "healthy" means the
    gateway can reach it."""
    _, host = server_hosts(deployment.placed_node)
    return f"http://{host}:{deployment.port}"


def portal_on_path() -> dict[str, str]:
    """The simulator (`inference.sim`) and vLLM's guard (`inference.vllm_guard`) are the portal's
    own code: put it on the server's path."""
    path = [str(settings.BASE_DIR), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
