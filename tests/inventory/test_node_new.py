"""The portal's own "Add a node" page: a node with its GPUs from pasted nvidia-smi output, or nothing."""

from __future__ import annotations

import pytest

from portal.inventory.models import Node
from tests.helpers.samples import nvidia_smi_sample

pytestmark = pytest.mark.django_db

QUERY = nvidia_smi_sample("v100_sxm2_8x_query.csv")
TOPO = nvidia_smi_sample("v100_sxm2_8x_topo.txt")
BROKEN_TOPO = "GPU0\tGPU1\nGPU0\t X \tNV2\nthis is not a topology matrix\n"


def add(client, **fields):
    return client.post("/nodes/new/", {"name": "dgx-v100-02", **fields})


def test_it_links_the_node_list_to_the_portals_own_page(client, alice):
    client.force_login(alice)
    page = client.get("/nodes/").content.decode()
    assert 'href="/nodes/new/"' in page and "/admin/inventory/node/add/" not in page
    assert client.get("/nodes/new/").status_code == 200


def test_it_adds_a_node_with_its_gpus_and_nvlink_peers(client, alice):
    client.force_login(alice)
    response = add(client, hostname="10.0.0.7", nvidia_smi_query=QUERY, nvidia_smi_topology=TOPO)
    assert response.status_code == 302 and response["Location"] == "/nodes/dgx-v100-02/"
    node = Node.objects.get(name="dgx-v100-02")
    assert node.gpus.count() == 8 and all(gpu.nvlink_peers for gpu in node.gpus.all())
    assert node.hostname == "10.0.0.7"


def test_it_saves_nothing_when_the_topology_is_refused_and_keeps_the_pasted_text(client, alice):
    client.force_login(alice)
    response = add(client, nvidia_smi_query=QUERY, nvidia_smi_topology=BROKEN_TOPO)
    assert response.status_code == 400
    assert not Node.objects.filter(name="dgx-v100-02").exists()
    form = response.context["form"]
    assert list(form.errors) == ["nvidia_smi_topology"]
    assert form.errors["nvidia_smi_topology"][0].startswith("topology (`nvidia-smi topo -m`)")
    page = response.content.decode()
    assert "this is not a topology matrix" in page and "Tesla V100-SXM2-32GB" in page


def test_it_saves_the_node_once_the_broken_part_is_left_out(client, alice):
    client.force_login(alice)
    add(client, nvidia_smi_query=QUERY, nvidia_smi_topology=BROKEN_TOPO)
    assert add(client, nvidia_smi_query=QUERY).status_code == 302
    assert Node.objects.get(name="dgx-v100-02").gpus.count() == 8


def test_it_names_the_csv_when_the_gpu_list_is_refused(client, alice):
    client.force_login(alice)
    broken_csv = "index, name\n0, broken, extra, columns\n"
    response = add(client, nvidia_smi_query=broken_csv, nvidia_smi_topology=TOPO)
    assert list(response.context["form"].errors) == ["nvidia_smi_query"]
    assert not Node.objects.exists()


def test_it_is_for_staff_only(client, bob):
    client.force_login(bob)
    assert client.get("/nodes/new/").status_code == 403
    assert add(client).status_code == 403 and not Node.objects.exists()


def test_the_admin_also_refuses_a_broken_topology_without_saving_the_node(admin_client):
    response = admin_client.post(
        "/admin/inventory/node/add/",
        {
            "name": "dgx-v100-03",
            "nvidia_smi_query": QUERY,
            "nvidia_smi_topology": BROKEN_TOPO,
            "gpus-TOTAL_FORMS": "0",
            "gpus-INITIAL_FORMS": "0",
            "gpus-MIN_NUM_FORMS": "0",
            "gpus-MAX_NUM_FORMS": "1000",
        },
    )
    assert response.status_code == 200  # the form again, with its errors
    assert not Node.objects.filter(name="dgx-v100-03").exists()
    assert "this is not a topology matrix" in response.content.decode()


def test_it_keeps_the_topology_headers_leading_tab_so_the_columns_line_up(client, alice):
    client.force_login(alice)
    add(client, nvidia_smi_query=QUERY, nvidia_smi_topology=TOPO)
    assert Node.objects.get(name="dgx-v100-02").topology_text == TOPO
    page = client.get("/nodes/dgx-v100-02/").content.decode()
    assert '<pre class="topology">\tGPU0\tGPU1' in page


PLAIN_NVIDIA_SMI = """\
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 550.54.15              Driver Version: 550.54.15      CUDA Version: 12.4     |
|-----------------------------------------+------------------------+----------------------+
|   0  Tesla V100-SXM2-16GB           On  |   00000000:00:1E.0 Off |                    0 |
+-----------------------------------------+------------------------+----------------------+
"""


def test_it_names_the_command_to_run_when_plain_nvidia_smi_is_pasted(client, alice):
    client.force_login(alice)
    response = add(client, nvidia_smi_query=PLAIN_NVIDIA_SMI)
    assert response.status_code == 400
    message = response.context["form"].errors["nvidia_smi_query"][0]
    assert "nvidia-smi --query-gpu=index,name" in message and "--format=csv" in message


def test_it_shows_every_error_of_the_page_on_one_submit(client, alice):
    client.force_login(alice)
    response = client.post(
        "/nodes/new/", {"name": "new", "nvidia_smi_query": "garbage", "nvidia_smi_topology": BROKEN_TOPO}
    )
    assert response.status_code == 400
    assert set(response.context["form"].errors) == {"name", "nvidia_smi_query", "nvidia_smi_topology"}
