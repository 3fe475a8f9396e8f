from django.apps import AppConfig


class DashboardConfig(AppConfig):
    """The top of the stack: the front page, the demo data and the daily retention prune,
    which read or write several apps. Nothing imports it (docs/architecture.md#layers)."""

    name = "portal.dashboard"
    label = "dashboard"
