"""The node page's acceptance form fits the node: a CPU-only node gets the tiny shape, no "node's
GPU" to predict for, and every field's help text is shown."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.django_db


def test_a_cpu_only_node_defaults_to_the_tiny_shape_and_offers_no_gpu_of_its_own(client, alice, cpu_node):
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


def test_it_refuses_an_acceptance_the_planner_refuses_before_anything_is_written(pcie_box):
    from portal.benchmarks.acceptance.request import node_acceptance_request
    from portal.core.errors import ApplicationError
    from portal.inventory.models import NodeAcceptance

    with pytest.raises(ApplicationError) as refused:
        node_acceptance_request(node=pcie_box, shape="llama-2-7b-chat-hf", max_model_len=4096, send=False)
    assert refused.value.field == "max_model_len"
    assert "nothing was written" in refused.value.message and "max_model_len" in refused.value.message
    assert not NodeAcceptance.objects.exists()


def test_a_16_gb_v100_gets_a_default_form_the_planner_accepts_eager(client, alice, pcie_box):
    from portal.benchmarks.acceptance.request import node_acceptance_request

    client.force_login(alice)
    form = client.get(f"/nodes/{pcie_box.name}/").context["accept_form"]
    assert form["enforce_eager"].value() is True
    assert form["max_model_len"].value() is not None and form["max_model_len"].value() < 4096
    acceptance = node_acceptance_request(
        node=pcie_box,
        shape=form["shape"].value(),
        enforce_eager=True,
        max_model_len=form["max_model_len"].value(),
        send=False,
    )
    assert acceptance.enforce_eager and acceptance.profile_flags == {
        "max_model_len": form["max_model_len"].value()
    }


def test_the_form_offers_the_max_model_length_a_refusal_names(client, alice, pcie_box):
    client.force_login(alice)
    form = client.get(f"/nodes/{pcie_box.name}/").context["accept_form"]
    data = {name: form[name].value() or "" for name in form.fields}
    response = client.post(f"/nodes/{pcie_box.name}/accept/", {**data, "max_model_len": "4096"})
    assert response.status_code == 400
    assert "max_model_len" in response.context["accept_form"].errors


def test_the_command_names_the_planners_refusal_and_the_flag_to_change(pcie_box):
    from django.core.management import CommandError, call_command

    with pytest.raises(CommandError, match="max_model_len: the planner refuses"):
        call_command("accept_node", pcie_box.name, "--shape", "llama-2-7b-chat-hf", "--max-model-len", "4096")
