"""The REST API, fuzzed from its own OpenAPI schema (/api/schema/) with schemathesis.

Every operation gets generated requests (valid and invalid) as staff (who may
write) and as a team member (who may only read): none may answer 5xx, and a
documented answer must match its schema. Path parameters are either generated
freely (mostly unknown names: 404s) or, in valid cases, drawn from the objects
the test created, so updates, deletes and actions run on real rows. Hypothesis is
derandomized (the same examples every run) and bounded (about a minute in all).
"""

from __future__ import annotations

import pytest
import schemathesis

from portal.benchmarks.models import BenchmarkRun
from tests.helpers import builders
from tests.helpers.clients import basic_auth
from tests.helpers.fuzz import CHECKS, fuzz_schema

pytestmark = [pytest.mark.django_db, pytest.mark.slow]  # minutes of fuzzing: not in make test-fast

EXAMPLES = 8


@pytest.fixture
def objects(alice, bob, team, dgx, pcie_box, llama7b, qwen_bf16, profile_tp8):
    """Rows for the path parameters: {path prefix: values}."""
    deployment = builders.deployment(
        name="search-llama", team=team, model_version=llama7b, profile=profile_tp8, node=dgx,
        gpu_indices=list(range(8)), desired_state="stopped", state="stopped",
    )  # fmt: skip
    run = BenchmarkRun.objects.create(
        deployment=deployment, mix="short-qa", state="done", sla_concurrency=8, created_by=bob
    )
    return {
        "/api/v1/nodes/": [dgx.name, pcie_box.name],
        "/api/v1/gpus/": [str(pk) for pk in dgx.gpus.values_list("pk", flat=True)[:2]],
        "/api/v1/model-versions/": [llama7b.name, qwen_bf16.name],
        "/api/v1/profiles/": [profile_tp8.name],
        "/api/v1/deployments/": [deployment.name],
        "/api/v1/teams/": [team.slug],
        "/api/v1/benchmark-runs/": [str(run.pk)],
    }


def _on_real_objects(schema, objects: dict[str, list[str]]):
    """The same schema with each known path parameter limited to real rows (in valid cases)."""
    document = schema.raw_schema
    for path, item in document["paths"].items():
        values = next((v for prefix, v in objects.items() if path.startswith(prefix)), None)
        for operation in item.values():
            for parameter in operation.get("parameters", []) if isinstance(operation, dict) else []:
                if parameter.get("in") == "path" and values:
                    parameter["schema"] = {"type": "string", "enum": values}
    patched = schemathesis.openapi.from_dict(document)
    patched.app = schema.app
    return patched


@pytest.mark.parametrize(
    "user, real_objects",
    [("alice", False), ("alice", True), ("bob", True)],
    ids=["staff", "staff-on-real-objects", "member-on-real-objects"],
)
def test_the_api_never_fails(wsgi_app, objects, user, real_objects):
    headers = basic_auth(user, f"{user}-password")
    schema = schemathesis.openapi.from_wsgi("/api/schema/", wsgi_app, headers=headers)
    if real_objects:
        schema = _on_real_objects(schema, objects)
    failures = fuzz_schema(
        schema, lambda case: case.call_and_validate(headers=headers, checks=CHECKS), examples=EXAMPLES
    )
    assert not failures, "\n\n".join(failures)
