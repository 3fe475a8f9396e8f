"""A node's page: its GPUs and who holds them, its `nvidia-smi topo -m` matrix, its latest
acceptance with plots and, for staff, *Accept this node* (posted to acceptance/views.py). It reads
deployments (who holds each GPU) and acceptances (a benchmark of the node), so it lives here, above both."""

from __future__ import annotations

import datetime as dt

from django import forms
from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from inference.cuda_archs import missing_kernels, missing_vllm_kernels
from inference.engines import servable_lines
from inference.env_probe import build_advice
from portal.core.charts import Line, safe_svg, time_series_svg
from portal.deployments.selectors import gpus_held_on_node
from portal.inventory.selectors import gpu_samples_since, node_list
from portal.inventory.services import AgentRequest, gpu_mark_healthy, node_ask_agent

from .acceptance.forms import AcceptanceForm
from .acceptance.plots import acceptance_plots
from .acceptance.selectors import node_latest_acceptance


@login_required
def node_detail(request, name: str, *, accept_form: forms.Form | None = None, status: int = 200):
    node = get_object_or_404(node_list(), name=name)
    held = gpus_held_on_node(node)
    gpus = [(gpu, held.get(gpu.index, "")) for gpu in node.gpus.all()]
    context = {
        "node": node,
        "gpus": gpus,
        "kernel_warnings": _kernel_warnings(node, [g for g, _ in gpus]),
        "servable_engines": servable_lines([g.compute_capability for g, _ in gpus]) if gpus else [],
        "accept_form": accept_form or AcceptanceForm(node=node),
        **_acceptance_context(node),
        "gpu_health": _gpu_health(node, held),
        "gpu_health_unknown_checks": _unknown_checks(gpus),
        "gpu_health_hours": GPU_HEALTH_CHART_HOURS,
    }
    return render(request, "benchmarks/node_detail.html", context, status=status)


# The node page charts each GPU's per-minute samples over this many hours.
GPU_HEALTH_CHART_HOURS = 6


def _gpu_health(node, held: dict[int, str]) -> list[dict]:
    """Per GPU: its state, findings, the deployment holding it, its latest sample and two charts."""
    end = timezone.now()
    start = end - dt.timedelta(hours=GPU_HEALTH_CHART_HOURS)
    series = gpu_samples_since(node, start)
    rows = []
    for gpu in node.gpus.all():
        samples = series.get(gpu.index, [])
        holder = held.get(gpu.index, "")
        title = f"GPU {gpu.index} · {holder or 'free'}"
        times = [s.minute for s in samples]
        charts = []
        if samples:
            hot = Line(settings.GPU_HEALTH_TEMPERATURE_WARNING_C, "temperature warning", "sla")
            charts = [
                time_series_svg(
                    times,
                    {"utilization %": [s.utilization_pct for s in samples],
                     "temperature °C": [s.temperature_c for s in samples]},
                    start=start, end=end, title=title, unit="", lines=[hot], width=460, height=170,
                    chart_id=f"gpu-{gpu.index}-usage",
                ),
                time_series_svg(
                    times,
                    {"power W": [s.power_draw_w for s in samples],
                     "memory used GiB": [None if s.memory_used_mib is None else s.memory_used_mib / 1024
                                         for s in samples]},
                    start=start, end=end, title=f"GPU {gpu.index} power and memory", unit="", width=460,
                    height=170, chart_id=f"gpu-{gpu.index}-power",
                ),
            ]  # fmt: skip
        rows.append(
            {"gpu": gpu, "holder": holder, "latest": samples[-1] if samples else None, "charts": charts}
        )
    return rows


def _unknown_checks(gpus) -> str:
    """What the node's driver cannot be asked (fields it refused), said once for the node: the
    agent records it on every GPU as an info finding `checks_unknown` (inference/gpu_health/rules.py)."""
    for gpu, _ in gpus:
        for finding in gpu.health_findings or []:
            if finding.get("code") == "checks_unknown":
                return finding["message"].split(" on GPU ")[0] + " on every GPU of this node are unknown."
    return ""


@login_required
@require_POST
def gpu_mark_healthy_view(request, name: str, index: int):
    """Staff: the GPU was reset or its node rebooted; it takes work again (the next sample judges it)."""
    if not request.user.is_staff:
        raise PermissionDenied
    node = get_object_or_404(node_list(), name=name)
    gpu = get_object_or_404(node.gpus, index=index)
    gpu_mark_healthy(gpu=gpu, user=request.user)
    messages.success(request, f"GPU {gpu.index} of {node.name} marked healthy; the next sample judges it")
    return redirect(f"{node.get_absolute_url()}#gpu-health")


@login_required
@require_POST
def node_agent_request_view(request, name: str, what: str):
    """Staff: the node page's *Discover GPUs* and *Probe engine* buttons (the API's discover and
    probe-software actions)."""
    if not request.user.is_staff:
        raise PermissionDenied
    node = get_object_or_404(node_list(), name=name)
    try:
        asked = AgentRequest(what)
    except ValueError as error:
        raise Http404(f"no such request: {what}") from error
    node_ask_agent(node=node, request=asked, user=request.user)
    said = "read its GPUs" if asked is AgentRequest.DISCOVER else "report its engine (vLLM, torch, CUDA)"
    messages.success(request, f"asked the agent on {node.name} to {said}; reload this page in a moment")
    return redirect(node)


def _kernel_warnings(node, gpus) -> list[str]:
    """A torch build without the GPUs' sm_XY fails at the first kernel
    (docs/v100-field-guide.md#software-stack)."""
    if not gpus or not node.torch_cuda_version:
        return []
    ccs = [g.compute_capability for g in gpus]
    warnings = []
    missing = missing_kernels(node.torch_arch_list, ccs)
    if missing:
        warnings.append(
            f"torch {node.torch_version} has no {', '.join(missing)} kernels: {build_advice(missing)}"
        )
    lacking = missing_vllm_kernels(node.vllm_kernel_archs, ccs)
    if lacking:
        warnings.append(
            f"vLLM {node.vllm_version}'s own kernels have no {', '.join(lacking)}: {build_advice(lacking)}"
        )
    return warnings


def _acceptance_context(node) -> dict:
    acceptance = node_latest_acceptance(node)
    plots = [safe_svg(svg) for svg in acceptance_plots(acceptance.levels)] if acceptance else []
    return {"acceptance": acceptance, "acceptance_plots": plots}
