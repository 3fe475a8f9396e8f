"""Clients of the portal's API for tests."""

from __future__ import annotations

import base64

from rest_framework.test import APIClient


def api_client(user=None) -> APIClient:
    client = APIClient()
    if user is not None:
        client.force_authenticate(user)
    return client


def basic_auth(username: str, password: str) -> dict[str, str]:
    """An HTTP Basic `Authorization` header, for calls outside Django's test client."""
    return {"Authorization": "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()}


def admin_form_data(form) -> dict[str, str]:
    """What the browser would send for an admin form as it is shown (its current values)."""
    data: dict[str, str] = {}
    for name, field in form.fields.items():
        if field.disabled:
            continue
        value = form[name].value()
        if isinstance(value, bool):
            if value:
                data[name] = "on"
        elif value is not None:
            data[name] = field.prepare_value(value) if hasattr(field, "prepare_value") else value
    return data
