"""Celery task outcomes, counted in the process that ran the task (whatever machine it is on)."""

from __future__ import annotations

from celery.signals import task_failure, task_retry, task_success

from .prometheus import celery_task_outcome


def _name(sender) -> str:
    return getattr(sender, "name", None) or str(sender)


@task_success.connect(dispatch_uid="portal.metrics.task_success")
def _succeeded(sender=None, **_kwargs) -> None:
    celery_task_outcome(_name(sender), "succeeded")


@task_failure.connect(dispatch_uid="portal.metrics.task_failure")
def _failed(sender=None, **_kwargs) -> None:
    celery_task_outcome(_name(sender), "failed")


@task_retry.connect(dispatch_uid="portal.metrics.task_retry")
def _retried(sender=None, **_kwargs) -> None:
    celery_task_outcome(_name(sender), "retried")
