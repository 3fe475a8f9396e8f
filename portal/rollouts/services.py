"""Writes for rollouts: start, the task's evaluation, and the operators' pause, resume, promote and
roll back.

Every transition is a conditional update (`UPDATE … WHERE state = … AND current_step = …`, see
docs/concurrency.md) inside the transaction that also moves the shares, writes the timeline and the
audit log and asks deployments to stop: a second worker (or an operator) that evaluated the same
rollout at the same moment updates no row and does nothing, and a worker killed half way leaves
nothing half done. The next tick resumes from what the row says.
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import cast

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Max, Sum
from django.utils import timezone

from inference.errors import InputError
from inference.rollout import (
    DEFAULT_STEPS,
    Decision,
    Evaluation,
    Policy,
    Window,
    judge,
    parse_steps,
    split_share,
)
from portal.audit.services import audit_event_record
from portal.core.errors import ApplicationError
from portal.deployments.models import Deployment, DeploymentState, DesiredState
from portal.deployments.services import deployment_request_start, deployment_request_stop
from portal.observability.models import LatencyMinute
from portal.observability.services import latency_rollup
from portal.registry.models import ServedModel
from portal.registry.services import served_model_set_shares
from portal.teams.services import usage_flush

from .models import ACTIVE_ROLLOUT_STATES, Rollout, RolloutEvent, RolloutState
from .placement import GpuChoice, check_gpus, check_plan, check_release, hardware_warning, old_deployment_of

log = logging.getLogger(__name__)
MAX_INTERVAL_S = 3600


def _actor_repr(actor) -> str:
    return actor.get_username() if actor is not None else "system"


def _event(rollout: Rollout, kind: str, message: str, *, actor=None, data: dict | None = None) -> None:
    RolloutEvent.objects.create(
        rollout=rollout, kind=kind, message=message[:500], data=data or {}, actor_repr=_actor_repr(actor)
    )
    audit_event_record(
        action=f"rollout.{kind}", target=rollout, changes={"message": message, **(data or {})}, actor=actor
    )


def _shares(served_model: ServedModel) -> dict[str, int]:
    return dict(served_model.versions.values_list("model_version__name", "share_bp"))


def _set_new_share(rollout: Rollout, percent: int, *, actor=None, reason: str) -> dict[str, int]:
    """Give the new version `percent` of what the pair (old + new) carries; other versions keep theirs."""
    shares = _shares(rollout.served_model)
    old, new = rollout.from_version.name, rollout.to_version.name
    pair = shares.get(old, 0) + shares.get(new, 0)
    shares[new], shares[old] = split_share(pair, percent)
    served_model_set_shares(served_model=rollout.served_model, shares=shares, actor=actor, reason=reason)
    return shares


ANY_STEP = object()  # a claim that does not depend on the step (an operator's action)


def _claim(rollout: Rollout, *, states, step: object = ANY_STEP, **updates) -> bool:
    """Move the row only if it is still in one of `states` (and at `step`, unless ANY_STEP)."""
    rows = Rollout.objects.filter(pk=rollout.pk, state__in=list(states))
    if step is not ANY_STEP:
        rows = rows.filter(current_step=cast("int | None", step))
    claimed = rows.update(**updates, updated_at=timezone.now()) == 1
    if claimed:
        for name, value in updates.items():
            setattr(rollout, name, value)
    return claimed


# --- Start ---------------------------------------------------------------------------------------


def rollout_start(
    *,
    served_model: ServedModel,
    to_deployment: Deployment,
    steps: list | None = None,
    from_deployment: Deployment | None = None,
    gpu_choice: str = "",
    interval_s: int | None = None,
    min_requests: int | None = None,
    compare_sla_only: bool = False,
    actor=None,
) -> Rollout:
    """Roll `served_model` over to `to_deployment`'s version in `steps` (default 5/25/50/100 %, ten
    minutes each). The old version is `from_deployment`'s, else the one version that has a share now.
    The new version must have release hashes and pass the planner on its GPUs; it is asked to start
    if it is not running, and gets no traffic until it serves. Where its GPUs are held by the old
    version, the error offers the ways to free them and `gpu_choice` picks one (placement.GpuChoice).
    `interval_s` and `min_requests` set the rollout's own pace (default ROLLOUT_TICK_S and
    ROLLOUT_MIN_REQUESTS). Where the new deployment's GPU kind, count or tensor-parallel size differs
    from the old one's, the timeline starts with a `warning` (the latencies compare hardware, not
    versions); `compare_sla_only` judges the new version on the SLA and the error ceiling alone."""
    try:
        parsed = parse_steps([list(s) for s in DEFAULT_STEPS] if steps is None else steps)
    except InputError as error:
        raise ApplicationError.from_input_error(error) from None
    shares = _shares(served_model)
    to_version = to_deployment.model_version
    if from_deployment is not None:
        from_version = from_deployment.model_version
        if shares.get(from_version.name, 0) == 0:
            raise ApplicationError(
                f"`{from_version.name}` takes no traffic of `{served_model.name}`.", field="from_deployment"
            )
    else:
        live = [name for name, share in shares.items() if share > 0]
        if len(live) != 1:
            raise ApplicationError(
                f"`{served_model.name}` sends traffic to {len(live)} versions: name the old deployment.",
                field="from_deployment",
            )
        from_version = served_model.versions.get(model_version__name=live[0]).model_version
    if to_version.pk == from_version.pk:
        raise ApplicationError("The new deployment serves the old version.", field="to_deployment")
    if shares.get(to_version.name, 0) > 0:
        raise ApplicationError(
            f"`{to_version.name}` already takes traffic of `{served_model.name}`.", field="to_deployment"
        )
    if to_deployment.adopted:
        raise ApplicationError(
            "An adopted server cannot be started or stopped by a rollout.", field="to_deployment"
        )
    interval_s = settings.ROLLOUT_TICK_S if interval_s is None else interval_s
    min_requests = settings.ROLLOUT_MIN_REQUESTS if min_requests is None else min_requests
    if not 1 <= interval_s <= MAX_INTERVAL_S:
        raise ApplicationError(f"measure every 1 to {MAX_INTERVAL_S} s, not {interval_s}", field="interval_s")
    if not 1 <= min_requests <= 1_000_000:
        raise ApplicationError(
            f"a step needs 1 to 1000000 requests, not {min_requests}", field="min_requests"
        )
    check_release(to_version, to_deployment)
    check_plan(to_deployment)
    freeing = check_gpus(deployment=to_deployment, from_version=from_version, choice=gpu_choice)
    freed = Deployment.objects.get(name=freeing.deployment) if freeing is not None else None
    warning = hardware_warning(
        old=old_deployment_of(from_deployment=from_deployment, from_version=from_version), new=to_deployment
    )
    with transaction.atomic():
        try:
            with transaction.atomic():
                rollout = Rollout.objects.create(
                    served_model=served_model,
                    from_version=from_version,
                    to_version=to_version,
                    from_deployment=from_deployment,
                    to_deployment=to_deployment,
                    steps=[s.as_dict() for s in parsed],
                    freed_deployment=freed,
                    interval_s=interval_s,
                    min_requests=min_requests,
                    compare_sla_only=compare_sla_only,
                    downtime_s=freeing.downtime_s if freeing is not None else None,
                    created_by=actor,
                )
        except IntegrityError:
            raise ApplicationError(
                f"`{served_model.name}` already has a rollout in progress.", field="served_model"
            ) from None
        # The new version joins the served name at 0 %: listed, no traffic.
        served_model_set_shares(
            served_model=served_model,
            shares={**shares, to_version.name: 0},
            actor=actor,
            reason="rollout start",
        )
        if freeing is not None and freed is not None:
            # Its GPUs go to the new version: stopped now (the agent drains it first), started again
            # on a roll-back.
            deployment_request_stop(deployment=freed, user=actor)
            swap = (
                "swap in place" if freeing.choice == GpuChoice.IN_PLACE else "replica taken out of the pool"
            )
            _event(rollout, "free_gpus", f"{swap}: {freeing.message}", actor=actor, data=freeing.as_dict())
        if to_deployment.desired_state != DesiredState.RUNNING:
            deployment_request_start(deployment=to_deployment, user=actor)  # refuses when no GPU is free
        _event(
            rollout,
            "start",
            f"rollout of {served_model.name} from {from_version.name} to {to_version.name} "
            f"on {to_deployment.name}: steps "
            + ", ".join(f"{s.share_percent} % × {s.describe()}" for s in parsed)
            + ("; judged against the SLA only" if compare_sla_only else ""),
            actor=actor,
        )
        if warning:
            _event(rollout, "warning", warning, actor=actor)
    return rollout


# --- The task's evaluation -----------------------------------------------------------------------


def _policy(rollout: Rollout) -> Policy:
    deployment = rollout.to_deployment
    return Policy(
        sla_p95_ttft_ms=deployment.sla_p95_ttft_s * 1000,
        sla_p95_tpot_ms=deployment.sla_p95_tpot_s * 1000,
        min_requests=rollout.min_requests,
        max_error_rate_increase=settings.ROLLOUT_MAX_ERROR_RATE_INCREASE,
        max_latency_ratio=settings.ROLLOUT_MAX_LATENCY_RATIO,
        latency_margin_sla_fraction=settings.ROLLOUT_LATENCY_MARGIN_SLA_FRACTION,
        latency_margin_min_ms=settings.ROLLOUT_LATENCY_MARGIN_MIN_MS,
        max_error_rate=settings.ROLLOUT_MAX_ERROR_RATE,
        compare_sla_only=rollout.compare_sla_only,
    )


def _window(rows) -> Window:
    found = rows.aggregate(
        requests=Sum("requests"), errors=Sum("errors"), ttft=Max("p95_ttft_ms"), tpot=Max("p95_tpot_ms")
    )
    return Window(found["requests"] or 0, found["errors"] or 0, found["ttft"], found["tpot"])


def step_windows(rollout: Rollout, *, now: dt.datetime) -> tuple[Window, Window]:
    """(new, old): each version's gateway measurements from the minute the step began up to now
    (the worst minute's P95; counts summed). The old version's are taken over the same minutes as
    the new one's only: a quiet or a busy minute on one side alone is no comparison."""
    assert rollout.step_started_at is not None  # set with every step
    since = rollout.step_started_at.replace(second=0, microsecond=0)
    minutes = LatencyMinute.objects.filter(minute__gte=since, minute__lte=now)
    new_rows = minutes.filter(deployment_id=rollout.to_deployment_id)
    old_rows = (
        minutes.filter(deployment_id=rollout.from_deployment_id)
        if rollout.from_deployment_id
        else minutes.filter(deployment__model_version_id=rollout.from_version_id)
    )
    return _window(new_rows), _window(old_rows.filter(minute__in=new_rows.values("minute")))


def _enter_step(
    rollout: Rollout, index: int, *, now: dt.datetime, from_states, from_step, actor=None, data=None
) -> bool:
    """`data`: the evaluation that passed the step before (kept for the page and the timeline)."""
    step = rollout.step_list()[index]
    with transaction.atomic():
        if not _claim(
            rollout,
            states=from_states,
            step=from_step,
            state=RolloutState.STEPPING,
            current_step=index,
            step_started_at=now,
            evaluated_at=None,
            **({"measurements": data} if data else {}),
        ):
            return False
        _set_new_share(
            rollout, step.share_percent, actor=actor, reason=f"rollout {rollout.pk} step {index + 1}"
        )
        _event(
            rollout,
            "step",
            f"step {index + 1} of {len(rollout.steps)}: {rollout.to_version.name} takes "
            f"{step.share_percent} % for {step.describe()}",
            actor=actor,
            data={"step": index, "share_percent": step.share_percent, **({"passed": data} if data else {})},
        )
    return True


def _stop_later(deployment: Deployment | None) -> dict:
    """The fields that ask the next tick past one route-cache interval to stop `deployment`."""
    if deployment is None or deployment.adopted:
        return {}
    due = timezone.now() + dt.timedelta(seconds=settings.GATEWAY_CACHE_S + 1)
    return {"stop_deployment": deployment, "stop_due_at": due}


def rollouts_stop_due(*, now: dt.datetime | None = None) -> list[int]:
    """Ask the deployments whose stop is due to stop (the agent drains in-flight streams first);
    each claimed once by clearing `stop_due_at`. Returns the rollouts handled."""
    now = now or timezone.now()
    done = []
    for rollout in Rollout.objects.filter(stop_due_at__lte=now).select_related(
        "stop_deployment", "freed_deployment"
    ):
        with transaction.atomic():
            if Rollout.objects.filter(pk=rollout.pk, stop_due_at__isnull=False).update(stop_due_at=None) != 1:
                continue
            deployment = rollout.stop_deployment
            if deployment is not None and deployment.desired_state != DesiredState.STOPPED:
                deployment_request_stop(deployment=deployment)
                _event(rollout, "stop", f"{deployment.name} asked to stop: it takes no traffic any more")
            _restart_freed(rollout)
            done.append(rollout.pk)
    return done


def _restart_freed(rollout: Rollout) -> None:
    """After a roll-back or a failure, start again what was stopped to free the new version's GPUs
    (the new deployment has let them go by now: it is no longer wanted running)."""
    freed = rollout.freed_deployment
    if rollout.state not in (RolloutState.ROLLED_BACK, RolloutState.FAILED) or freed is None:
        return
    if freed.desired_state == DesiredState.RUNNING:
        return
    try:
        deployment_request_start(deployment=freed)
    except ApplicationError as error:  # e.g. its GPUs taken meanwhile: say so, ops start it elsewhere
        _event(rollout, "restart", f"{freed.name} could not be started again: {error.message}")
        return
    _event(
        rollout, "restart", f"{freed.name} asked to start again: it gave its GPUs to the rolled-back version"
    )


def _roll_back(rollout: Rollout, *, reason: str, data: dict, from_states, from_step, actor=None) -> bool:
    with transaction.atomic():
        if not _claim(
            rollout,
            states=from_states,
            step=from_step,
            state=RolloutState.ROLLED_BACK,
            reason=reason,
            measurements=data,
            finished_at=timezone.now(),
            **_stop_later(rollout.to_deployment),
        ):
            return False
        _set_new_share(rollout, 0, actor=actor, reason=f"rollout {rollout.pk} rolled back")
        _event(rollout, "roll_back", reason, actor=actor, data=data)
    return True


def _promote(rollout: Rollout, *, from_states, from_step, actor=None, data: dict | None = None) -> bool:
    with transaction.atomic():
        if not _claim(
            rollout,
            states=from_states,
            step=from_step,
            state=RolloutState.PROMOTED,
            reason="",
            finished_at=timezone.now(),
            **_stop_later(rollout.from_deployment),
        ):
            return False
        _set_new_share(rollout, 100, actor=actor, reason=f"rollout {rollout.pk} promoted")
        _event(
            rollout,
            "promote",
            f"promoted: {rollout.to_version.name} takes all of {rollout.served_model.name}",
            actor=actor,
            data=data or {},
        )
    return True


def _fail(rollout: Rollout, reason: str) -> bool:
    with transaction.atomic():
        if not _claim(
            rollout,
            states=[RolloutState.WARMING],
            state=RolloutState.FAILED,
            reason=reason,
            finished_at=timezone.now(),
            # A failed start that took GPUs from the old version gives them back.
            **(_stop_later(rollout.to_deployment) if rollout.freed_deployment_id else {}),
        ):
            return False
        _set_new_share(rollout, 0, reason=f"rollout {rollout.pk} failed")
        _event(rollout, "fail", reason)
    return True


def _pause_outage(rollout: Rollout, *, reason: str, data: dict, step: int) -> bool:
    """Both versions fail: hold the shares where they are and say it is an outage. Neither advancing
    (onto a version that fails) nor rolling back (onto one that fails as well) would help; an
    operator resumes once the cause is fixed."""
    with transaction.atomic():
        if not _claim(
            rollout,
            states=[RolloutState.STEPPING],
            step=step,
            state=RolloutState.PAUSED,
            reason=f"paused in step {step + 1}, {reason}",
            measurements=data,
        ):
            return False
        _event(rollout, "outage", f"paused in step {step + 1}, {reason}", data=data)
    return True


def rollout_evaluate(*, rollout: Rollout, now: dt.datetime | None = None) -> str:
    """One evaluation of one rollout by the task; returns what it did (for logs and tests)."""
    now = now or timezone.now()
    rollout = Rollout.objects.select_related(
        "served_model", "from_version", "to_version", "to_deployment", "from_deployment"
    ).get(pk=rollout.pk)
    if rollout.state == RolloutState.WARMING:
        deployment = rollout.to_deployment
        if deployment.state == DeploymentState.SERVING and deployment.endpoint_url:
            return (
                "serving"
                if _enter_step(rollout, 0, now=now, from_states=[RolloutState.WARMING], from_step=None)
                else "-"
            )
        if deployment.state == DeploymentState.FAILED or deployment.desired_state == DesiredState.STOPPED:
            why = f"the new deployment {deployment.name} is {deployment.state}"
            why += f": {deployment.state_reason}" if deployment.state_reason else ""
            return "failed" if _fail(rollout, why) else "-"
        if (now - rollout.created_at).total_seconds() > settings.ROLLOUT_WARMUP_TIMEOUT_S:
            limit = settings.ROLLOUT_WARMUP_TIMEOUT_S
            why = f"the new deployment {deployment.name} was not serving after {limit} s"
            return "failed" if _fail(rollout, why) else "-"
        return "warming"
    if rollout.state != RolloutState.STEPPING:
        return "-"
    steps = rollout.step_list()
    index, started = rollout.current_step, rollout.step_started_at
    assert index is not None and started is not None  # STEPPING: set by the claim into the step
    new, old = step_windows(rollout, now=now)
    elapsed = (now - started).total_seconds()
    policy = _policy(rollout)
    verdict = judge(new=new, old=old, policy=policy, step=steps[index], elapsed_s=elapsed)
    data = Evaluation(
        step=index,
        elapsed_s=round(elapsed),
        new=new,
        old=old,
        decision=verdict.decision,
        rule=verdict.rule,
        reasons=verdict.reasons,
        sla_p95_ttft_ms=policy.sla_p95_ttft_ms,
        sla_p95_tpot_ms=policy.sla_p95_tpot_ms,
        compare_sla_only=policy.compare_sla_only,
    ).as_dict()
    if verdict.decision == Decision.PAUSE:
        return "outage" if _pause_outage(rollout, reason=verdict.reasons[0], data=data, step=index) else "-"
    if verdict.decision == Decision.ROLL_BACK:
        done = _roll_back(
            rollout,
            reason=f"breach in step {index + 1}: " + "; ".join(verdict.reasons),
            data=data,
            from_states=[RolloutState.STEPPING],
            from_step=index,
        )
        return "rolled_back" if done else "-"
    if verdict.decision == Decision.ADVANCE:
        if index + 1 == len(steps):
            return (
                "promoted"
                if _promote(rollout, from_states=[RolloutState.STEPPING], from_step=index, data=data)
                else "-"
            )
        advanced = _enter_step(
            rollout, index + 1, now=now, from_states=[RolloutState.STEPPING], from_step=index, data=data
        )
        return "advanced" if advanced else "-"
    # Hold: keep the latest numbers for the page (the same row, the same step: harmless if two write).
    Rollout.objects.filter(pk=rollout.pk, state=RolloutState.STEPPING, current_step=index).update(
        measurements=data, evaluated_at=now
    )
    return "hold"


def _due(rollout: Rollout, now: dt.datetime) -> bool:
    """A step is measured every `interval_s` (a warm-up is checked at every tick). Half a second of
    slack: beat's ticks drift a little, and a tick just short of the interval would skip a whole one."""
    if rollout.state != RolloutState.STEPPING or rollout.evaluated_at is None:
        return True
    return (now - rollout.evaluated_at).total_seconds() >= rollout.interval_s - 0.5


def measurements_refresh(*, now: dt.datetime, lookback_s: int) -> None:
    """Bring the gateway's measurements up to now: store the usage records still queued in Redis and
    recompute the per-minute latency rows of the last `lookback_s` (idempotent), so a step is
    judged on what the gateway saw up to this tick, not on the minute rollup's last run."""
    try:
        usage_flush()
    except Exception:  # Redis down: judge on what is stored; the next tick flushes
        log.exception("rollouts: flushing the usage records failed")
    latency_rollup(since=now - dt.timedelta(seconds=lookback_s), until=now + dt.timedelta(minutes=1))


def rollouts_advance_all(*, now: dt.datetime | None = None) -> dict[int, str]:
    """Evaluate every active rollout that is due (the beat task); one failing rollout does not stop
    the rest."""
    now = now or timezone.now()
    done = {}
    try:
        for pk in rollouts_stop_due(now=now):
            done[pk] = "stop"
    except Exception:
        log.exception("rollouts: asking deployments to stop failed; the next tick tries again")
    active = Rollout.objects.filter(state__in=[RolloutState.WARMING, RolloutState.STEPPING])
    due = [rollout for rollout in active if _due(rollout, now)]
    stepping = [r.interval_s for r in due if r.state == RolloutState.STEPPING]
    if stepping:
        try:
            measurements_refresh(now=now, lookback_s=max(stepping) + 120)
        except Exception:
            log.exception("rollouts: refreshing the measurements failed; judging on the stored ones")
    for rollout in due:
        try:
            done[rollout.pk] = rollout_evaluate(rollout=rollout, now=now)
        except Exception:
            log.exception("rollout %s: evaluation failed; the next tick tries again", rollout.pk)
            done[rollout.pk] = "error"
    return done


# --- Operators -----------------------------------------------------------------------------------


def _refresh(rollout: Rollout) -> Rollout:
    return Rollout.objects.select_related(
        "served_model", "from_version", "to_version", "to_deployment", "from_deployment"
    ).get(pk=rollout.pk)


def _not_now(rollout: Rollout, verb: str) -> ApplicationError:
    return ApplicationError(
        f"A rollout that is {rollout.get_state_display()} cannot be {verb}.", field="state"
    )


def rollout_pause(*, rollout: Rollout, actor=None) -> Rollout:
    """Hold the shares as they are; nothing advances (a breach is not judged either) until resumed."""
    rollout = _refresh(rollout)
    with transaction.atomic():
        if not _claim(
            rollout, states=[RolloutState.STEPPING, RolloutState.WARMING], state=RolloutState.PAUSED
        ):
            raise _not_now(rollout, "paused")
        _event(rollout, "pause", "paused", actor=actor)
    return rollout


def rollout_resume(*, rollout: Rollout, actor=None) -> Rollout:
    """Go on from the step it was paused in; that step's minutes count again from now."""
    rollout = _refresh(rollout)
    state = RolloutState.WARMING if rollout.current_step is None else RolloutState.STEPPING
    with transaction.atomic():
        if not _claim(rollout, states=[RolloutState.PAUSED], state=state, step_started_at=timezone.now()):
            raise _not_now(rollout, "resumed")
        _event(rollout, "resume", f"resumed ({state})", actor=actor)
    return rollout


def rollout_promote(*, rollout: Rollout, actor=None) -> Rollout:
    """Send all the pair's traffic to the new version now and stop the old deployment."""
    rollout = _refresh(rollout)
    if rollout.to_deployment.state != DeploymentState.SERVING:
        raise ApplicationError(
            f"The new deployment {rollout.to_deployment.name} is {rollout.to_deployment.state}, not serving.",
            field="to_deployment",
        )
    if not _promote(
        rollout,
        from_states=[RolloutState.STEPPING, RolloutState.PAUSED, RolloutState.WARMING],
        from_step=ANY_STEP,
        actor=actor,
    ):
        raise _not_now(rollout, "promoted")
    return rollout


def rollout_rollback(*, rollout: Rollout, actor=None, reason: str = "") -> Rollout:
    """Send nothing to the new version from now on and stop its deployment."""
    rollout = _refresh(rollout)
    why = f"rolled back by {_actor_repr(actor)}" + (f": {reason[:300]}" if reason else "")
    if not _roll_back(
        rollout, reason=why, data={}, from_states=ACTIVE_ROLLOUT_STATES, from_step=ANY_STEP, actor=actor
    ):
        raise _not_now(rollout, "rolled back")
    return rollout
