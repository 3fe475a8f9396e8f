"""The demo data's team member: the team side of the portal without a trip to the admin."""

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.urls import reverse

pytestmark = pytest.mark.django_db


def test_it_seeds_a_team_member_whose_password_sits_beside_the_admins(client, tmp_path):
    call_command("seed_demo", "--admin-password-file", str(tmp_path / "admin-password"))
    password_file = tmp_path / "member-password"
    assert password_file.stat().st_mode & 0o077 == 0
    password = password_file.read_text().strip()
    member = get_user_model().objects.get(username="member")
    assert not member.is_staff and list(member.teams.values_list("slug", flat=True)) == ["platform"]
    # Through the login form, as a person would (django-axes wants the request).
    signed_in = client.post(reverse("login"), {"username": "member", "password": password})
    assert signed_in.status_code == 302
    assert "Platform" in client.get("/").content.decode()


def test_it_keeps_the_members_password_when_seeded_again(tmp_path):
    call_command("seed_demo", "--admin-password-file", str(tmp_path / "admin-password"))
    first = (tmp_path / "member-password").read_text()
    call_command("seed_demo", "--admin-password-file", str(tmp_path / "admin-password"))
    assert (tmp_path / "member-password").read_text() == first
    assert get_user_model().objects.filter(username="member").count() == 1
