"""The node page's acceptance form fits the node: a CPU-only node gets the tiny shape, no "node's
GPU" to predict for, and every field's help text is shown."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.django_db


def test_a_cpu_only_node_defaults_to_the_tiny_shape_and_offers_no_gpu_of_its_own(
    client, alice, cpu_node
):
    client.force_login(alice)
    response = client.get(f"/nodes/{cpu_node.name}/")
    form = response.context["accept_form"]
    assert form["shape"].value() == "tiny"
    labels = dict(form.fields["predict_gpu"].choices)
    assert "the node's GPU" not in labels.values() and "no GPU" in labels[""]
    assert "enforce_eager" not in form.fields
    page = response.content.decode()
    assert '<option value="tiny" selected>' in page
    assert "2 to 4 levels of concurrent users" in page and "The GPU the simulator predicts" in page


def test_a_gpu_node_keeps_the_7b_shape_and_its_own_gpu(client, alice, dgx):
    client.force_login(alice)
    form = client.get(f"/nodes/{dgx.name}/").context["accept_form"]
    assert form["shape"].value() == "llama-2-7b-chat-hf"
    assert dict(form.fields["predict_gpu"].choices)[""] == "the node's GPU"
    assert "enforce_eager" in form.fields


def test_a_cpu_node_accepts_the_forms_defaults(client, alice, cpu_node):
    from portal.inventory.models import NodeAcceptance

    client.force_login(alice)
    form = client.get(f"/nodes/{cpu_node.name}/").context["accept_form"]
    data = {name: form[name].value() or "" for name in form.fields}  # what the browser sends
    response = client.post(f"/nodes/{cpu_node.name}/accept/", data)
    assert response.status_code == 302, response.content.decode()[:2000]
    acceptance = NodeAcceptance.objects.get(node=cpu_node)
    assert (acceptance.shape, acceptance.dtype, acceptance.predict_gpu) == ("tiny", "float32", "")


def test_the_command_and_the_service_default_a_cpu_only_node_to_the_tiny_shape(cpu_node, dgx):
    from portal.benchmarks.acceptance.request import node_acceptance_request

    assert node_acceptance_request(node=cpu_node, send=False).shape == "tiny"
    assert node_acceptance_request(node=dgx, send=False).shape == "llama-2-7b-chat-hf"
