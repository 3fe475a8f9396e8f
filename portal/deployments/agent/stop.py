"""Stop a deployment's server on this node: drain (the gateway stops routing to it and in-flight
requests finish), stop the process group, confirm it is gone and the port free."""

from __future__ import annotations

import time

from django.conf import settings

from inference import server_log, supervisor

from ..models import Deployment, DeploymentState, DesiredState, EventStatus
from .environment import local_url, server_hosts
from .lease import NO_PROCESS, Lease, LeaseLost, agent_owner, deployment_load, lease_acquire, process_identity
from .steps import StepFailed, event, step


def deployment_stop(deployment_id: int, *, owner: str, drain: bool = True) -> str:
    """Drain, stop the process group, confirm it is gone and the port free, then `stopped`."""
    # A start holding the lease notices the desired state and gives up within a
    # poll, so waiting for the lease a little is enough.
    lease = lease_acquire(deployment_id, owner=owner, wait_s=min(30, settings.DEPLOYMENT_LEASE_TTL_S))
    if lease is None:
        return "busy"
    try:
        deployment = deployment_load(deployment_id)
        if deployment.desired_state == DesiredState.RUNNING:
            return "wanted running"
        return stop_under_lease(lease, deployment, drain=drain, reason="stopped")
    except StepFailed:
        return "failed"
    except LeaseLost:
        return "lease lost"
    finally:
        lease.release()


def stop_under_lease(lease: Lease, deployment: Deployment, *, drain: bool, reason: str) -> str:
    did = deployment.pk
    if deployment.adopted:
        event(did, "stop", EventStatus.SKIPPED, "an adopted server is never stopped by the portal")
        return "adopted"
    if not supervisor.group_alive(deployment.pgid, process_identity(deployment)):
        if deployment.state != DeploymentState.STOPPED or deployment.pid:
            lease.write(
                state=DeploymentState.STOPPED,
                state_reason=reason,
                **NO_PROCESS,
            )
            event(did, "stop", EventStatus.OK, "no server process was running")
        return "stopped"
    if drain and deployment.state == DeploymentState.SERVING and deployment.endpoint_url:
        # `draining` takes it out of serving_deployments_for_model: the gateway stops routing to it.
        lease.write(state=DeploymentState.DRAINING, state_reason="draining before stop")
        with step(did, "drain", started="no new requests; waiting for in-flight ones") as result:
            result["message"] = _drain(lease, deployment)
    lease.write(state=DeploymentState.STOPPING, state_reason="stopping")
    with step(did, "stop") as result:
        stopped = supervisor.stop_group(
            deployment.pgid,
            grace_s=settings.DEPLOYMENT_STOP_GRACE_S,
            kill_wait_s=15,
            identity=process_identity(deployment),
        )
        if not stopped.gone:
            lease.write(
                state=DeploymentState.FAILED, state_reason=f"process group {deployment.pgid} survived SIGKILL"
            )
            raise StepFailed("stop", f"process group {deployment.pgid} survived SIGKILL", "stop")
        bind_host, _ = server_hosts(deployment.node)
        port_free = deployment.port is None or supervisor.wait_port_free(
            bind_host, deployment.port, timeout_s=15
        )
        result["message"] = (
            f"{stopped.signal} after {stopped.seconds:.1f} s; process group {deployment.pgid} gone; "
            + (f"port {deployment.port} free" if port_free else f"port {deployment.port} STILL TAKEN")
        )
    lease.write(
        state=DeploymentState.STOPPED,
        state_reason=reason if port_free else f"{reason}; port {deployment.port} is held by another process",
        **NO_PROCESS,
        log_tail=server_log.log_tail(deployment.log_path),
    )
    return "stopped"


def _drain(lease: Lease, deployment: Deployment) -> str:
    """Wait until vLLM reports no running or waiting request, up to the drain deadline."""
    base = local_url(deployment)
    began = time.monotonic()
    deadline = began + settings.DEPLOYMENT_DRAIN_TIMEOUT_S
    while True:
        lease.renew()
        metrics = supervisor.scrape_metrics(base, timeout_s=2, api_key=deployment.engine_api_key)
        in_flight = None if metrics is None else (metrics.running or 0) + (metrics.waiting or 0)
        if in_flight == 0:
            return f"no request in flight after {time.monotonic() - began:.1f} s"
        if metrics is None:
            return "no /metrics answer: nothing to wait for"
        if time.monotonic() >= deadline:
            limit = settings.DEPLOYMENT_DRAIN_TIMEOUT_S
            return f"{in_flight:.0f} requests still in flight at the {limit} s deadline"
        time.sleep(0.5)


def stop_node_servers(node_name: str, *, reason: str) -> int:
    """Stop every server process of the node now (no drain), leaving desired states alone."""
    stopped = 0
    for pk in (
        Deployment.objects.filter(node__name=node_name, adopted=False)
        .exclude(pgid=None)
        .values_list("pk", flat=True)
    ):
        lease = lease_acquire(pk, owner=agent_owner("shutdown"), wait_s=5)
        if lease is None:
            continue
        try:
            stop_under_lease(lease, deployment_load(pk), drain=False, reason=reason)
            stopped += 1
        except (StepFailed, LeaseLost):
            pass
        finally:
            lease.release()
    return stopped
