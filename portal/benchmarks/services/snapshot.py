"""What a run measured, frozen when it is created: the deployment's snapshot, the server's version,
and each level's share of the bandwidth roofline the snapshot's planner figures give."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from inference.planner import GB
from portal.core.errors import ApplicationError
from portal.deployments.launch import knob_values
from portal.deployments.models import Deployment
from portal.deployments.services import deployment_plan


def deployment_tokenizer_path(deployment: Deployment) -> str:
    """The deployment's own tokenizer.json when this machine can read it (the control worker may not)."""
    directory = (deployment.model_version.path or "").strip()
    if directory and (Path(directory) / "tokenizer.json").is_file():
        return str(Path(directory) / "tokenizer.json")
    return ""


def deployment_snapshot(deployment: Deployment) -> dict:
    """What was measured, frozen when a run starts: profile, model version, node, GPUs, roofline inputs.

    An adopted endpoint (a server the portal did not start) has no profile, and maybe no node:
    what it lacks is left empty, never guessed.
    """
    profile = deployment.profile
    model = deployment.model_version
    node = deployment.node
    gpus: list[dict[str, Any]] = (
        [
            {"index": g.index, "name": g.name, "memory_mib": g.memory_mib, "bandwidth_gb_s": g.bandwidth_gb_s}
            for g in node.gpus.filter(index__in=deployment.gpu_indices or []).order_by("index")
        ]
        if node is not None
        else []
    )
    snapshot = {
        "deployment": deployment.name,
        "team": deployment.team.slug,
        "adopted": deployment.adopted,
        "profile": (
            {"name": profile.name, **knob_values(profile)} if profile is not None else {}
        ),
        "engine": (profile.engine if profile is not None else "")
        or (node.engine if node is not None else "")
        or deployment.engine_used,
        "model_version": {
            "name": model.name,
            "source": model.source,
            "revision": model.revision,
            "weights_sha256": model.weights_sha256,
            "tokenizer_sha256": model.tokenizer_sha256,
            "param_count": model.param_count,
        },
        "node": (
            {"name": node.name, "engine": node.engine, "driver_version": node.driver_version}
            if node is not None
            else {}
        ),
        "gpus": gpus,
        "vllm_version": getattr(node, "vllm_version", "") or "",
    }
    try:
        plan = deployment_plan(deployment)
    except ApplicationError:
        plan = None
    if plan is not None and gpus:
        snapshot["roofline"] = {
            "weights_bytes_per_gpu": plan.weights_gb_per_gpu * GB,
            "kv_bytes_per_token_per_gpu": plan.kv_cache_bytes_per_token_per_gpu,
            "bandwidth_gb_s": min(g["bandwidth_gb_s"] for g in gpus),
        }
    return snapshot


def server_version(base_url: str, *, api_key: str = "") -> str:
    """vLLM serves its version at /version; other servers may not ("" then)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{base_url.rstrip('/')}/version", timeout=3, headers=headers)
        if response.status_code == 200:
            return str(response.json().get("version") or "")
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    return ""


def roofline_share(level: dict, snapshot: dict) -> dict | None:
    """Achieved share of the bandwidth roofline: bytes read per decode step ÷ (mean TPOT × GPU bandwidth).

    Bytes per step per GPU = its weight shard (planner) + the KV cache of the running batch
    (planner's bytes per token × concurrency × the mean context: prompt + half the output).
    """
    roofline = snapshot.get("roofline")
    tpot_ms = level.get("mean_tpot_ms")
    completed = level.get("completed") or 0
    if not roofline or not tpot_ms or not completed:
        return None
    batch = level.get("concurrency") or (level.get("little_law") or {}).get("concurrency_used") or 1
    mean_context = (level.get("total_input_tokens", 0) + level.get("total_output_tokens", 0) / 2) / completed
    step_bytes = (
        roofline["weights_bytes_per_gpu"] + roofline["kv_bytes_per_token_per_gpu"] * batch * mean_context
    )
    share = step_bytes / (tpot_ms / 1000 * roofline["bandwidth_gb_s"] * GB)
    return {
        "bytes_per_step_per_gpu": step_bytes,
        "bandwidth_gb_s": roofline["bandwidth_gb_s"],
        "share": share,
    }
