"""Tasks for the task-outcome test: a real worker imports this module (`celery worker --include`)."""

from __future__ import annotations

from celery import shared_task


@shared_task(name="metrics_test.ok")
def ok() -> int:
    return 1


@shared_task(name="metrics_test.boom")
def boom() -> None:
    raise RuntimeError("boom")


@shared_task(name="metrics_test.flaky", bind=True, max_retries=1, default_retry_delay=0)
def flaky(self, attempts_before_success: int = 1) -> int:
    """Fails, is retried once, then succeeds."""
    if self.request.retries < attempts_before_success:
        raise self.retry(exc=RuntimeError("not yet"), countdown=0)
    return self.request.retries
