"""Every admin form's box a person may empty means something when emptied: it saves the column's
default instead of None, which a NOT NULL column refuses with a 500 (issue 38)."""

from __future__ import annotations

import pytest
from django.contrib import admin
from django.contrib.auth.models import User
from django.core.exceptions import ValidationError
from django.test import RequestFactory

from tests.helpers.clients import admin_form_data

pytestmark = pytest.mark.django_db


def test_it_saves_an_emptied_extra_args_box_as_no_extra_args(admin_client, profile_tp1):
    profile_tp1.extra_args = ["--seed", "0"]
    profile_tp1.save(update_fields=["extra_args"])
    url = f"/admin/deployments/deploymentprofile/{profile_tp1.pk}/change/"
    data = {**admin_form_data(admin_client.get(url).context["adminform"].form), "extra_args": ""}
    response = admin_client.post(url, data)
    assert response.status_code == 302, response.context["adminform"].form.errors
    profile_tp1.refresh_from_db()
    assert profile_tp1.extra_args == []


def test_it_lands_on_the_profiles_own_page_after_saving_it(admin_client, profile_tp1):
    url = f"/admin/deployments/deploymentprofile/{profile_tp1.pk}/change/"
    response = admin_client.post(url, admin_form_data(admin_client.get(url).context["adminform"].form))
    assert response.status_code == 302
    assert response["Location"] == f"/profiles/{profile_tp1.name}/"


def test_no_admin_form_turns_an_emptied_box_into_a_null_its_column_refuses():
    request = RequestFactory().get("/")
    request.user = User(is_superuser=True, is_staff=True)
    nulls = []
    for model, model_admin in admin.site._registry.items():
        for name, field in model_admin.get_form(request).base_fields.items():
            if field.required or field.disabled or name not in {f.name for f in model._meta.concrete_fields}:
                continue
            if model._meta.get_field(name).null:
                continue
            try:
                cleaned = field.clean("")
            except ValidationError:  # refused with a message: that is allowed
                continue
            if cleaned is None:
                nulls.append(f"{model.__name__}.{name}")
    assert nulls == []
