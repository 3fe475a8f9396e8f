"""Running a node acceptance on the node itself (the agent's `benchmarks.accept_node` task, or
`manage.py accept_node` run there): claim the record, run the steps in order, always stop the
reference server, then judge.

The steps (`steps.py`), each written to the record as it happens so the node page shows progress:

1. discover the GPUs (nvidia-smi), read their health (inference/gpu_health/; not healthy: failed),
   and probe the vLLM environment;
2. write a reference model with random weights in the chosen shape (`inference.tiny_model`),
   into `ACCEPTANCE_MODEL_DIR` (same seed, same bytes: registered once, hashed like any release);
3. start it through the deployments' own lifecycle (`deployment_start`: planner, hashes, launch,
   health, warm-up, smoke test), on a deployment of the `acceptance` team, with vLLM's defaults
   or a deployment profile's launch flags (`options.LAUNCH_FLAGS`);
4. with a deployment profile that turns on chunked prefill or prefix caching (`--profile`), probe
   them (`feature_probe.py`: a prompt over the token budget, a prompt twice, then /health), as
   vLLM marks both unsupported on Volta (vllm#2729, vllm#3687); then
   benchmark the levels with the load generator (`inference.loadgen`), one level at a time, then
   read the GPUs' health again (after the load);
5. predict the same profile and workload with the simulator, and fit the node's calibration;
6. stop the deployment (always, also after a failure), then judge: `slow` when any level is
   slower than predicted by more than the margin (docs/decisions.md, "Node acceptance").

The run holds the record's lease (portal/core/jobs, docs/jobs.md; ACCEPTANCE_STALE_S, renewed by
every write), and every write of the record goes through its fence: an acceptance that another
request declared abandoned, or that another runner took over after this one stalled past its
lease, stops at its next write instead of overwriting the verdict.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from portal.core.jobs import claim, worker_name
from portal.inventory.models import AcceptanceState, NodeAcceptance

from . import steps
from .feature_probe import feature_label
from .judging import judge
from .options import QUEUED, probed_features
from .record import AcceptanceAbandoned, AcceptanceContext, AcceptanceStepFailed, RunningAcceptance

logger = logging.getLogger(__name__)


def node_acceptance_run(
    *, acceptance_id: int, on_progress: Callable[[dict], None] | None = None, worker: str = ""
) -> NodeAcceptance:
    """Run the whole acceptance on this machine (it must be the node); returns the finished record."""
    # The claim: the first runner moves it off `queued` (a duplicate message does nothing while
    # its lease is live); a runner whose lease lapsed is taken over, and the run starts over.
    lease = claim(
        NodeAcceptance,
        acceptance_id,
        worker=worker or worker_name(),
        ttl_s=settings.ACCEPTANCE_STALE_S,
        claimable=Q(state=AcceptanceState.RUNNING) & (Q(step=QUEUED) | ~Q(lease_owner="")),
        live=Q(state=AcceptanceState.RUNNING),
        step="claimed",
        progress=[],
        deployment_name="",
    )
    acceptance = NodeAcceptance.objects.select_related("node").get(pk=acceptance_id)
    if lease is None:
        return acceptance  # another runner has it, or it was abandoned before it started
    run = RunningAcceptance(acceptance, lease, on_progress)
    context = AcceptanceContext()
    error, crash, abandoned = "", None, False
    try:
        _run_steps(run, context)
    except AcceptanceStepFailed as failure:
        error = f"{run.acceptance.step}: {failure.message}"
    except AcceptanceAbandoned:
        abandoned = True
        logger.warning("node acceptance %s was abandoned while it ran", acceptance_id)
    except Exception as exc:  # recorded, the server stopped, then raised for the worker's log
        logger.exception("node acceptance %s crashed", acceptance_id)
        crash, error = exc, f"{run.acceptance.step}: unexpected error: {exc!r}"
    if context.deployment_id:
        # The reference server never outlives its acceptance, whatever happened above.
        stop_error = steps.stop_reference(run, context.deployment_id)
        error = error or stop_error
    if not abandoned:
        if error:
            _finish(run, AcceptanceState.FAILED, error=error)
        else:
            state, verdict = judge(run.acceptance.levels, margin=run.acceptance.margin)
            if context.calibration_failed:
                verdict += f"; no calibration: {context.calibration_failed}"
            _finish(run, state, verdict=verdict)
    if crash is not None:
        raise crash
    acceptance.refresh_from_db()
    return acceptance


def _finish(run: RunningAcceptance, state: str, *, verdict: str = "", error: str = "") -> None:
    with contextlib.suppress(AcceptanceAbandoned):
        run.lease.finish(state=state, verdict=verdict, error=error, finished_at=timezone.now())


def _run_steps(run: RunningAcceptance, context: AcceptanceContext) -> None:
    # Each step is looked up on its module when it runs, so a test can stand one in.
    acceptance = run.acceptance
    node = acceptance.node
    run.step("discover", "reading the GPUs with nvidia-smi", lambda: steps.discover_gpus(node))
    run.step("gpu-health-start", "reading GPU health", lambda: steps.read_health(run, node, "start"))
    run.step("probe", "probing the vLLM environment", lambda: steps.probe_software(run, node))
    run.step(
        "model", f"writing the reference model ({acceptance.shape})", lambda: steps.write_model(run, context)
    )
    run.step(
        "start", "starting it through the deployment lifecycle", lambda: steps.start_reference(run, context)
    )
    # Only with a profile that turns them on: a deployment's smoke test never reaches them.
    features = probed_features(acceptance.profile_flags)
    if features:
        names = " and ".join(feature_label(flag) for flag in features)
        run.step("feature_probe", f"probing {names}", lambda: steps.feature_probe(run, context))
    run.step(
        "bench", f"benchmarking {acceptance.concurrency} users", lambda: steps.bench_levels(run, context)
    )
    # Right after the load: a card that overheats, throttles or logs ECC errors under it shows now.
    run.step(
        "gpu-health-end", "reading GPU health after the load", lambda: steps.read_health(run, node, "end")
    )
    run.step(
        "predict", "simulating the same profile and workload", lambda: steps.predict_levels(run, context)
    )
    # The verdict stands without a calibration: a failed fit is recorded, not fatal.
    context.calibration_failed = run.step(
        "calibrate",
        "fitting the simulator to the measured levels",
        lambda: steps.calibrate_node(run, context),
        required=False,
    )
