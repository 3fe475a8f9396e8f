"""Real-browser fixtures: one headless Chromium per session, a fresh page per test.

The browser is Debian's /usr/bin/chromium (Playwright's own browser downloads do
not work here, so never run `playwright install`). Tests drive pytest-django's
`live_server`, which needs a transactional database:
mark tests `pytest.mark.django_db(transaction=True)`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from tests.helpers.browser import check_accessibility_on_every_load

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
TIMEOUT_MS = 15_000


@pytest.fixture(scope="session")
def browser() -> Browser:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing: apt-get install chromium")
    # Playwright's sync API keeps an asyncio event loop running in the test thread, and
    # Django then refuses ORM calls from that thread (SynchronousOnlyOperation), even
    # though nothing here runs concurrently. The tests and fixtures only touch the ORM
    # from plain synchronous code, so lifting the guard while the browser lives is safe.
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            yield browser
            browser.close()
    finally:
        os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)


@pytest.fixture
def page(browser: Browser) -> Page:
    """A page in its own context, so cookies (the session) never leak between tests. Every page it
    loads is checked for contrast and name violations; any found fail the test at its end."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    violations = check_accessibility_on_every_load(page)
    yield page
    context.close()
    assert not violations, "accessibility (axe-core):\n" + "\n".join(violations)


@pytest.fixture(scope="module")
def stack(django_db_setup, django_db_blocker, tmp_path_factory):
    """The running stack (tests/helpers/stack.py) against the test database, once per module.

    Its tests must be transactional, so what they write is committed where the stack's
    processes can read it. A failing test's report ends with every process's log tail
    (see pytest_runtest_makereport below).
    """
    from django.conf import settings
    from django.db import connection

    from tests.helpers.stack import start_stack, stop_stack

    started = start_stack(
        database=connection.settings_dict,
        redis_url=settings.CELERY_BROKER_URL,
        tmp=tmp_path_factory.mktemp("stack"),
    )
    yield started
    stop_stack(started)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    running = item.funcargs.get("stack") if hasattr(item, "funcargs") else None
    if report.failed and running is not None:
        report.sections.append(("stack logs (tails)", running.log_tails()))
