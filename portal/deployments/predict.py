"""Predict a concurrency sweep of a profile with the simulator's virtual clock.

Shared by `manage.py simulate` and the planner's "predict this profile" page:
the inputs are resolved exactly as the planner resolves them (registered or
bundled model, catalog GPUs, settings through `settings_from`), then
`inference.sim.virtual.sweep` runs the same scheduler as the simulated server
on a virtual clock.

A node's calibration (the host-side constants `inference.sim.calibration` fits from
levels measured on it) is applied with `calibration=`; `calibrate_sweep` fits one from a
`manage.py bench --json` report and predicts with it.
"""

from __future__ import annotations

import time

from django import forms
from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.shortcuts import render

from inference.errors import InputError
from inference.loadgen.sla import Sla
from inference.loadgen.workloads import PRESETS, load_mix
from inference.sim.calibration import fit_host_costs, measured_levels
from inference.sim.costs import HostCosts
from inference.sim.engine import EngineConfig, EngineRefused
from inference.sim.virtual import OutOfTime, sweep
from portal.core.charts import run_plots, safe_svg
from portal.core.errors import ApplicationError

from .forms import PlannerForm
from .services import resolve_model, settings_from, target_placement

DEFAULT_CONCURRENCY = (16, 32, 64, 128, 256)
# The page answers in about five seconds: half the command's requests per level (levels then
# read a few per cent below steady state).
PAGE_REQUESTS_PER_USER = 10
PAGE_MIN_REQUESTS = 100


def parse_concurrency(text: str) -> list[int]:
    """ "16,32,64" → [16, 32, 64]; anything else is an ApplicationError on `concurrency`."""
    levels = []
    for part in (text or "").split(","):
        part = part.strip()
        # ASCII digits only ("²".isdigit() is true) and few of them (int() refuses 4300+ digits).
        if not (part.isascii() and part.isdigit() and len(part) <= 9) or int(part) < 1:
            raise ApplicationError(
                f"levels must be whole numbers ≥ 1, got {part[:20]!r}", field="concurrency"
            )
        levels.append(int(part))
    return levels


def _engine_config(
    *,
    model: str,
    gpu: str,
    gpus: int,
    nvlink: bool | None,
    allow_paths: bool,
    host: HostCosts,
    settings_values: dict,
) -> EngineConfig:
    placement = target_placement(gpu_key=gpu, gpu_count=gpus, nvlink_connected=nvlink)
    arch = resolve_model(model, allow_paths=allow_paths)
    if not settings_values.get("tensor_parallel_size"):
        settings_values["tensor_parallel_size"] = gpus
    profile = settings_from(**settings_values)
    return EngineConfig(
        model=arch, profile=profile, gpu=placement.gpu, nvlink=placement.nvlink_connected, host=host
    )


def host_costs(calibration: dict[str, float] | None) -> HostCosts:
    """A calibration object (as `simulate --json` prints it) → HostCosts; None → the defaults."""
    try:
        return HostCosts() if calibration is None else HostCosts.from_dict(calibration)
    except InputError as error:
        raise ApplicationError.from_input_error(error) from error


def node_calibration(node_name: str) -> dict[str, float] | None:
    """The calibration of the named node's latest acceptance, or None when it has none (yet).

    The record and its selector come with node acceptance (`node_latest_calibration` in
    portal/inventory/selectors.py); a build without them predicts uncalibrated.
    """
    from portal.inventory import selectors
    from portal.inventory.models import Node

    node = Node.objects.filter(name=node_name).first()
    if node is None:
        raise ApplicationError(f"no node is named {node_name!r}", field="node")
    latest = getattr(selectors, "node_latest_calibration", None)
    return latest(node) if latest is not None else None


def page_levels(text: str) -> list[int]:
    """The page's levels, bounded: it simulates inside the web process (PREDICT_MAX_*)."""
    levels = parse_concurrency(text)
    if len(levels) > settings.PREDICT_MAX_LEVELS:
        raise ApplicationError(
            f"at most {settings.PREDICT_MAX_LEVELS} levels here; `manage.py simulate` takes more",
            field="concurrency",
        )
    if max(levels) > settings.PREDICT_MAX_CONCURRENCY:
        raise ApplicationError(
            f"levels are at most {settings.PREDICT_MAX_CONCURRENCY} here; `manage.py simulate` goes higher",
            field="concurrency",
        )
    return levels


def predict_sweep(
    *,
    model: str,
    gpu: str,
    gpus: int,
    mix: str,
    concurrency: list[int],
    nvlink: bool | None = None,
    allow_paths: bool = False,
    requests_per_level: int | None = None,
    seed: int = 0,
    sla: Sla | None = None,
    calibration: dict[str, float] | None = None,
    time_budget_s: float | None = None,
    **settings_values,
) -> dict:
    """{"levels": [...], "sla_concurrency": N, "sla_reason": str, "calibration": {name: s}}.

    The tensor-parallel size defaults to all the GPUs, as the planner's does. `calibration`
    is a node's fitted host costs (names missing from it keep their defaults); None
    predicts with the uncalibrated defaults, and "calibration" in the result says which.
    With `time_budget_s`, a sweep still running after that many seconds is an ApplicationError.
    """
    host = host_costs(calibration)
    config = _engine_config(
        model=model,
        gpu=gpu,
        gpus=gpus,
        nvlink=nvlink,
        allow_paths=allow_paths,
        host=host,
        settings_values=settings_values,
    )
    try:
        workload = load_mix(mix, allow_files=allow_paths)
        deadline = None if time_budget_s is None else time.monotonic() + time_budget_s
        result = sweep(
            config,
            workload,
            concurrency,
            requests_per_level=requests_per_level,
            seed=seed,
            sla=sla,
            deadline=deadline,
        )
    except OutOfTime as error:
        raise ApplicationError(
            f"the prediction ran out of its {time_budget_s:g} s budget during level {error.concurrency} "
            f"({len(error.levels)} of {len(concurrency)} levels done): ask for fewer or lower levels, "
            "or run `manage.py simulate`",
            field="concurrency",
        ) from None
    except InputError as error:
        raise ApplicationError.from_input_error(error) from error
    except EngineRefused as error:
        raise ApplicationError(f"vLLM would not start this profile: {error}", field="profile") from error
    result["calibration"] = host.as_dict()
    return result


def calibrate_sweep(
    *,
    measured: dict,
    fit_levels: list[int] | None = None,
    calibration: dict[str, float] | None = None,
    model: str,
    gpu: str,
    gpus: int,
    mix: str,
    concurrency: list[int],
    nvlink: bool | None = None,
    allow_paths: bool = False,
    requests_per_level: int | None = None,
    seed: int = 0,
    sla: Sla | None = None,
    **settings_values,
) -> dict:
    """Fit the host costs to `measured` (a `manage.py bench --json` report), then predict.

    The other arguments are `predict_sweep`'s, and the profile and workload must be those
    the report was measured with. `fit_levels` picks the report's levels to fit on
    (default: all its closed-loop levels); `calibration` is the starting point, e.g. the
    node's calibration from a CUDA-graph run when fitting an eager one. Returns
    `predict_sweep`'s result for `concurrency`, whose "calibration" is the fitted one, plus
    "fit": the fitted names and measured vs predicted on the fit levels.
    """
    config = _engine_config(
        model=model,
        gpu=gpu,
        gpus=gpus,
        nvlink=nvlink,
        allow_paths=allow_paths,
        host=host_costs(calibration),
        settings_values=dict(settings_values),
    )
    try:
        levels = measured_levels(measured, only=fit_levels)
        fit = fit_host_costs(config, load_mix(mix, allow_files=allow_paths), levels, seed=seed)
    except InputError as error:
        raise ApplicationError.from_input_error(error) from error
    except EngineRefused as error:
        raise ApplicationError(f"vLLM would not start this profile: {error}", field="profile") from error
    result = predict_sweep(
        model=model,
        gpu=gpu,
        gpus=gpus,
        mix=mix,
        concurrency=concurrency,
        nvlink=nvlink,
        allow_paths=allow_paths,
        requests_per_level=requests_per_level,
        seed=seed,
        sla=sla,
        calibration=fit.host.as_dict(),
        **settings_values,
    )
    result["fit"] = {"fitted": list(fit.fitted), "levels": fit.levels, "evaluations": fit.evaluations}
    return result


class PredictForm(forms.Form):
    mix = forms.CharField(initial="field-mix", help_text=", ".join(PRESETS) + " or fixed:<in>:<out>")
    concurrency = forms.CharField(initial=",".join(map(str, DEFAULT_CONCURRENCY)))
    node = forms.ChoiceField(
        required=False,
        choices=(),
        help_text="calibrate with this node's latest acceptance (blank: the uncalibrated defaults)",
    )

    def __init__(self, *args, **kwargs) -> None:
        from portal.inventory.models import Node

        super().__init__(*args, **kwargs)
        self.fields["node"].choices = [("", "none")] + [
            (name, name) for name in Node.objects.order_by("name").values_list("name", flat=True)
        ]


@login_required
def predict(request):
    """The planner's inputs plus a mix and levels → the simulated sweep (GET, linkable)."""
    planner_form = PlannerForm(request.GET)
    predict_form = PredictForm(request.GET if "mix" in request.GET else None)
    result, error, calibrated_by = None, None, None
    if planner_form.is_valid():
        mix = request.GET.get("mix") or "field-mix"
        node_name = request.GET.get("node") or ""
        try:
            calibration = node_calibration(node_name) if node_name else None
            if calibration is not None:
                calibrated_by = node_name
            levels = page_levels(request.GET.get("concurrency") or ",".join(map(str, DEFAULT_CONCURRENCY)))
            # Bounded through the levels: at most 10 × PREDICT_MAX_CONCURRENCY requests per level.
            per_level = max(PAGE_MIN_REQUESTS, PAGE_REQUESTS_PER_USER * max(levels))
            result = predict_sweep(
                **planner_form.target_values(),
                mix=mix,
                concurrency=levels,
                requests_per_level=per_level,
                calibration=calibration,
                time_budget_s=settings.PREDICT_TIME_BUDGET_S,
                **planner_form.settings_values(),
            )
        except ApplicationError as exc:
            error = f"{exc.field}: {exc.message}" if exc.field else exc.message
    else:
        error = "; ".join(f"{field}: {' '.join(errors)}" for field, errors in planner_form.errors.items())
    hidden = [(key, value) for key, value in request.GET.items() if key not in ("mix", "concurrency", "node")]
    return render(
        request,
        "deployments/predict.html",
        {
            "result": result,
            "plots": _plots(result),
            "error": error,
            "calibrated_by": calibrated_by,
            "node_asked": request.GET.get("node") or "",
            "predict_form": predict_form,
            "hidden": hidden,
            "query": request.GET.urlencode(),
        },
        # A bare visit (nothing asked yet) is no bad request; a refused or over-budget one is.
        status=400 if error and request.GET else 200,
    )


def _plots(result: dict | None) -> list:
    """The sweep drawn like a benchmark run's levels, against the SLA it was judged by."""
    if not result:
        return []
    sla = Sla()
    return [
        safe_svg(svg)
        for svg in run_plots(result["levels"], sla_ttft_s=sla.p95_ttft_s, sla_tpot_s=sla.p95_tpot_s)
    ]
