"""Steps every browser test takes: log in through the real form; save a screenshot; check each page
it visits for what a person cannot read or a screen reader cannot name (axe-core)."""

from __future__ import annotations

from contextlib import suppress
from functools import cache
from pathlib import Path

from tests.helpers import ROOT

SCREENSHOTS = ROOT / "test-artifacts" / "screenshots"


def login(page, live_server, username: str, password: str, next_path: str = "/") -> None:
    """Log in through the real form and wait until the portal shows the user in the header."""
    from playwright.sync_api import expect

    page.goto(f"{live_server.url}/accounts/login/?next={next_path}")
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.get_by_role("button", name="Log in").click()
    expect(page.locator("header.top")).to_contain_text(username)


def shot(page, name: str) -> Path:
    """Save a full-page PNG to test-artifacts/screenshots/<name>.png for a person to look at."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


# What a person cannot read (contrast) and what a screen reader cannot name: the checks issue 38
# asked for, where the Stop button's label was red on red and every test still clicked it by role.
AXE_RULES = ("color-contrast", "button-name", "link-name", "label")


@cache
def _axe():
    from axe_playwright_python.sync_playwright import Axe

    return Axe()


def accessibility_violations(page) -> list[str]:
    """axe-core's AXE_RULES on the page as it is now: one line per element that fails, naming the page."""
    options = {"runOnly": {"type": "rule", "values": list(AXE_RULES)}, "resultTypes": ["violations"]}
    response = _axe().run(page, options=options).response
    return [
        f"{page.url}: {violation['id']}: {node['target']} {node.get('failureSummary', '')}"
        for violation in response["violations"]
        for node in violation["nodes"]
    ]


def check_accessibility_on_every_load(page) -> list[str]:
    """Run accessibility_violations after every page load of `page` (a goto, a click that navigates,
    a form's redirect); the list it returns fills with what they find, for the test's end to assert."""
    from playwright.sync_api import Error

    found: list[str] = []

    def on_load(loaded) -> None:
        # Error: the page navigated on before the check ended; the next page's load checks that one.
        with suppress(Error):
            found.extend(accessibility_violations(loaded))

    page.on("load", on_load)
    return found
