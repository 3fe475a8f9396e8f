"""The node admin's GPU rows: each box named for a screen reader (a tabular inline names only its columns)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.django_db


def test_the_admins_gpu_rows_name_each_box_for_a_screen_reader(admin_client, dgx):
    page = admin_client.get(f"/admin/inventory/node/{dgx.pk}/change/").content.decode()
    assert 'id="id_gpus-0-index"' in page
    assert 'aria-label="Index"' in page and 'aria-label="Delete"' in page
