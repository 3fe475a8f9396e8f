"""Steps every browser test takes: log in through the real form; save a screenshot."""

from __future__ import annotations

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
