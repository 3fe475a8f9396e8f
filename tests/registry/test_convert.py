"""bf16 → fp16 conversion jobs: the service, the command, the API and the pages.

Real safetensors files on disk, the real database; the conversion runs in-process
here (the Celery agent on a node queue is tested in test_convert_agent.py).
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
from django.core.management import CommandError, call_command
from django.db.models import F
from django.utils import timezone

from inference.hashing import hash_model_dir
from portal.core.errors import ApplicationError
from portal.registry.models import ConversionJob, ConversionState, ModelVersion
from portal.registry.services import (
    CONVERSION_MARKER,
    conversion_job_run,
    conversion_job_start,
    model_version_create,
)
from tests.helpers.clients import api_client
from tests.helpers.safetensors import bf16_bits, bf16_tensor, expected_fp16_bits, fp16_bits_of, make_model
from tests.helpers.samples import bundled_config

pytestmark = pytest.mark.django_db

VALUES = [bf16_bits(v) for v in (0.0, -1.5, 65280.0, 2.0**-24, 3.140625)] + [0x7F80, 0x7FC0]
BIG = [bf16_bits(65536.0), bf16_bits(-(2.0**20))]


def bf16_model(root: Path, name: str = "qwen-bf16", *, extra_bits=()) -> ModelVersion:
    """A registered bf16 model version with two real shards, a tokenizer and a qwen config."""
    config = bundled_config("qwen2.5-7b-instruct")
    make_model(
        root / name,
        {
            "model-00001-of-00002.safetensors": {
                "embed": bf16_tensor(VALUES + list(extra_bits)),
                "norm": ("F32", (2,), np.array([1.0, 2.0], dtype="<f4").tobytes()),
            },
            "model-00002-of-00002.safetensors": {"lm_head": bf16_tensor([bf16_bits(0.25)] * 8, shape=(2, 4))},
        },
        config=config,
        extra={"model.safetensors.index.json": b'{"weight_map": {}}'},
    )
    return model_version_create(name=name, config=config, path=str(root / name), source="Qwen/Qwen2.5-7B")


def run(version: ModelVersion, **kwargs) -> ConversionJob:
    job = conversion_job_start(model_version=version, **kwargs)
    return conversion_job_run(job_id=job.pk)


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_it_registers_an_fp16_version_with_fresh_hashes(tmp_path):
    version = bf16_model(tmp_path)
    job = run(version)
    assert job.state == ConversionState.SUCCEEDED
    new = job.result
    assert new.name == "qwen-bf16-fp16"
    assert new.weight_dtype == "float16"
    assert new.config["torch_dtype"] == "float16"
    assert new.num_layers == version.num_layers
    assert new.source == "Qwen/Qwen2.5-7B"
    assert new.path == str(tmp_path / "qwen-bf16-fp16")
    fresh = hash_model_dir(new.path)
    assert (new.weights_sha256, new.tokenizer_sha256) == (fresh.weights_sha256, fresh.tokenizer_sha256)
    assert new.weight_files == fresh.weight_files
    assert new.weights_sha256 != version.weights_sha256
    assert leftovers(tmp_path) == ["qwen-bf16", "qwen-bf16-fp16"]  # no work directory left


def test_the_new_versions_page_says_where_it_came_from(client, tmp_path, bob):
    job = run(bf16_model(tmp_path, extra_bits=BIG), clamp=True)
    client.force_login(bob)
    text = client.get(job.result.get_absolute_url()).content.decode()
    assert "fp16 copy of" in text and f"conversion #{job.pk}" in text and "2 values clamped" in text


def test_the_registered_files_hold_the_expected_fp16_bits(tmp_path):
    job = run(bf16_model(tmp_path))
    got = fp16_bits_of(Path(job.result.path) / "model-00001-of-00002.safetensors", "embed")
    assert [hex(b) for b in got[:5]] == [hex(expected_fp16_bits(b)) for b in VALUES[:5]]
    assert hex(got[5]) == "0x7c00"
    assert np.isnan(got[6:].view(np.float16)).all()
    assert job.nonfinite_total == 2
    assert (job.tensors_done, job.tensors_total) == (3, 3)
    assert job.bytes_done == job.bytes_total > 0
    assert job.percent == 100.0


def test_it_stops_on_overflow_with_a_report_and_registers_nothing(tmp_path):
    version = bf16_model(tmp_path, extra_bits=BIG)
    job = run(version)
    assert job.state == ConversionState.FAILED
    assert "65504" in job.error and "clamp" in job.error
    assert job.overflow_total == 2
    assert job.overflows == [
        {"file": "model-00001-of-00002.safetensors", "tensor": "embed", "count": 2, "max_abs": 2.0**20}
    ]
    assert list(ModelVersion.objects.values_list("name", flat=True)) == ["qwen-bf16"]
    assert leftovers(tmp_path) == ["qwen-bf16"]


def test_it_clamps_when_asked_and_reports_how_many(tmp_path):
    job = run(bf16_model(tmp_path, extra_bits=BIG), clamp=True, new_name="qwen-fp16-clamped")
    assert job.state == ConversionState.SUCCEEDED
    assert job.result.name == "qwen-fp16-clamped"
    assert job.overflow_total == 2
    got = fp16_bits_of(Path(job.result.path) / "model-00001-of-00002.safetensors", "embed")
    assert [hex(b) for b in got[-2:]] == ["0x7bff", "0xfbff"]


@pytest.mark.parametrize(
    "config_name, field",
    [("llama-2-7b-chat-hf", "model_version"), ("gemma-2-27b-it-gptq-4bit", "model_version")],
)
def test_it_refuses_versions_that_are_not_plain_bf16(tmp_path, config_name, field):
    version = model_version_create(name="m", config=bundled_config(config_name), path=str(tmp_path))
    with pytest.raises(ApplicationError) as error:
        conversion_job_start(model_version=version)
    assert error.value.field == field
    assert not ConversionJob.objects.exists()


def test_it_refuses_a_name_that_is_taken_or_malformed(tmp_path, qwen_bf16):
    version = bf16_model(tmp_path)
    with pytest.raises(ApplicationError, match="already exists"):
        conversion_job_start(model_version=version, new_name="qwen2.5-7b-instruct")
    with pytest.raises(ApplicationError) as error:
        conversion_job_start(model_version=version, new_name="a/b")
    assert error.value.field == "name"


def test_it_refuses_a_second_job_for_the_same_output_while_one_is_live(tmp_path):
    version = bf16_model(tmp_path)
    first = conversion_job_start(model_version=version)
    with pytest.raises(ApplicationError, match=f"job {first.pk} is already writing"):
        conversion_job_start(model_version=version)


def test_it_fails_cleanly_when_the_output_exists(tmp_path):
    version = bf16_model(tmp_path)
    (tmp_path / "qwen-bf16-fp16").mkdir()
    job = run(version)
    assert job.state == ConversionState.FAILED
    assert "already exists" in job.error
    assert ModelVersion.objects.count() == 1


def test_an_exception_mid_way_leaves_no_version_and_no_directory(tmp_path):
    version = bf16_model(tmp_path)
    job = conversion_job_start(model_version=version)

    def explode(progress):
        if progress.tensors_done == 1:
            raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        conversion_job_run(job_id=job.pk, progress=explode)
    job.refresh_from_db()
    assert job.state == ConversionState.FAILED
    assert job.error == "RuntimeError: disk on fire"
    assert ModelVersion.objects.count() == 1
    assert leftovers(tmp_path) == ["qwen-bf16"]


def test_a_stale_job_is_superseded_and_the_rerun_starts_clean(tmp_path):
    version = bf16_model(tmp_path)
    old = conversion_job_start(model_version=version)
    # What a worker killed mid-way leaves: a running job whose lease lapsed, a work dir.
    ConversionJob.objects.filter(pk=old.pk).update(
        state=ConversionState.RUNNING, attempt=1, lease_expires_at=timezone.now() - timedelta(seconds=1)
    )
    old.refresh_from_db()
    assert old.is_stale
    half = tmp_path / f".qwen-bf16-fp16.partial-job{old.pk}-1"
    half.mkdir()
    (half / "model-00001-of-00002.safetensors").write_bytes(b"half written")

    new = run(version)
    assert new.state == ConversionState.SUCCEEDED
    old.refresh_from_db()
    assert old.state == ConversionState.FAILED
    assert "interrupted" in old.error
    assert leftovers(tmp_path) == ["qwen-bf16", "qwen-bf16-fp16"]


def test_a_worker_that_lost_its_job_registers_nothing(tmp_path):
    version = bf16_model(tmp_path)
    job = conversion_job_start(model_version=version)

    def taken_over(progress):
        # Another attempt claimed the job (our lease lapsed): the fence stops us.
        ConversionJob.objects.filter(pk=job.pk).update(attempt=99, lease_token=F("lease_token") + 1)

    conversion_job_run(job_id=job.pk, progress=taken_over)
    assert ModelVersion.objects.count() == 1
    assert leftovers(tmp_path) == ["qwen-bf16"]


def test_running_a_finished_job_again_is_a_no_op(tmp_path):
    job = run(bf16_model(tmp_path))
    again = conversion_job_run(job_id=job.pk)
    assert again.state == ConversionState.SUCCEEDED
    assert again.attempt == 1
    assert ModelVersion.objects.count() == 2


def test_a_rerun_removes_a_complete_but_unregistered_output(tmp_path):
    version = bf16_model(tmp_path)
    # Killed after the rename, before the commit: the directory is whole, nothing is registered.
    orphan = tmp_path / "qwen-bf16-fp16"
    orphan.mkdir()
    (orphan / CONVERSION_MARKER).write_text(json.dumps({"job": 1}))
    (orphan / "model.safetensors").write_bytes(b"x")
    job = run(version)
    assert job.state == ConversionState.SUCCEEDED
    assert not (orphan / "model.safetensors").exists()


# --- the command ------------------------------------------------------------------


def test_the_command_converts_and_prints_the_report(tmp_path, capsys):
    version = bf16_model(tmp_path)
    call_command("convert_bf16", "--model", version.name, "--name", "q16", "--output", str(tmp_path / "o"))
    out = capsys.readouterr()
    assert "3 tensors (2 bf16 → fp16, 1 copied)" in out.out
    assert "registered q16 at " + str(tmp_path / "o") in out.out
    assert "2 NaN/inf values kept" in out.out
    assert "100.0%" in out.err
    assert ModelVersion.objects.get(name="q16").weight_dtype == "float16"


def test_the_command_reports_overflow_and_fails(tmp_path, capsys):
    version = bf16_model(tmp_path, extra_bits=BIG)
    with pytest.raises(CommandError, match="failed: 2 values in 1 tensors exceed fp16's range"):
        call_command("convert_bf16", "--model", version.name)
    assert "would overflow: model-00001-of-00002.safetensors:embed 2 values (max |x| 1.04858e+06)" in (
        capsys.readouterr().out
    )
    call_command("convert_bf16", "--model", version.name, "--clamp")
    assert "clamped: model-00001-of-00002.safetensors:embed 2 values" in capsys.readouterr().out


def test_the_command_names_the_bad_flag(tmp_path, llama7b):
    with pytest.raises(CommandError, match="--model: no registered model version 'nope'"):
        call_command("convert_bf16", "--model", "nope")
    with pytest.raises(CommandError, match=r"--model: .* float16 weights"):
        call_command("convert_bf16", "--model", llama7b.name)
    version = bf16_model(tmp_path)
    with pytest.raises(CommandError, match="--output: relative/dir is not an absolute path"):
        call_command("convert_bf16", "--model", version.name, "--output", "relative/dir")


# --- the API ----------------------------------------------------------------------


def test_staff_start_a_conversion_on_the_node_through_the_api(
    tmp_path, alice, cpu_node, django_capture_on_commit_callbacks
):
    version = bf16_model(tmp_path)
    with django_capture_on_commit_callbacks() as callbacks:
        response = api_client(alice).post(
            f"/api/v1/model-versions/{version.name}/convert-fp16/", {"clamp": True}, format="json"
        )
    assert response.status_code == 202, response.json()
    body = response.json()
    assert (body["state"], body["node"], body["new_name"], body["clamp"]) == (
        "queued",
        "local",
        "qwen-bf16-fp16",
        True,
    )
    assert len(callbacks) == 1  # the task, sent to node.local once committed
    job = ConversionJob.objects.get(pk=body["id"])
    assert job.requested_by == alice


def test_the_api_names_the_node_when_there_is_more_than_one(tmp_path, alice, cpu_node, dgx):
    version = bf16_model(tmp_path)
    response = api_client(alice).post(
        f"/api/v1/model-versions/{version.name}/convert-fp16/", {}, format="json"
    )
    assert response.status_code == 400
    assert "node" in response.json()
    response = api_client(alice).post(
        f"/api/v1/model-versions/{version.name}/convert-fp16/", {"node": "dgx-v100-01"}, format="json"
    )
    assert response.json()["node"] == "dgx-v100-01"


def test_the_api_refuses_a_float16_version_naming_the_field(alice, llama7b, cpu_node):
    response = api_client(alice).post(
        f"/api/v1/model-versions/{llama7b.name}/convert-fp16/", {}, format="json"
    )
    assert response.status_code == 400
    assert "only bf16" in response.json()["model_version"][0]


@pytest.mark.parametrize("who", ["bob", "charlie"])
def test_only_staff_may_start_a_conversion(request, tmp_path, who, cpu_node):
    version = bf16_model(tmp_path)
    user = request.getfixturevalue(who)
    response = api_client(user).post(
        f"/api/v1/model-versions/{version.name}/convert-fp16/", {}, format="json"
    )
    assert response.status_code == 403
    assert api_client().post(f"/api/v1/model-versions/{version.name}/convert-fp16/").status_code == 403
    assert not ConversionJob.objects.exists()


def test_signed_in_users_read_job_progress(tmp_path, bob):
    job = run(bf16_model(tmp_path))
    response = api_client(bob).get(f"/api/v1/conversion-jobs/{job.pk}/")
    assert response.status_code == 200
    body = response.json()
    assert (body["state"], body["percent"], body["result"], body["stale"]) == (
        "succeeded",
        100.0,
        "qwen-bf16-fp16",
        False,
    )
    assert body["report"]["tensors_converted"] == 2
    assert api_client().get(f"/api/v1/conversion-jobs/{job.pk}/").status_code == 403


# --- pages ------------------------------------------------------------------------


def test_staff_start_a_conversion_from_the_model_page(client, tmp_path, alice, cpu_node):
    version = bf16_model(tmp_path)
    client.force_login(alice)
    page = client.get(version.get_absolute_url())
    assert b"Convert to fp16" in page.content
    response = client.post(f"/models/{version.name}/convert/", {"node": "local", "name": "", "clamp": ""})
    job = ConversionJob.objects.get()
    assert response.status_code == 302
    assert response["Location"] == job.get_absolute_url()
    page = client.get(job.get_absolute_url())
    assert b'<progress class="conversion" max="100" value="0.0">' in page.content
    assert b'http-equiv="refresh"' in page.content  # live while queued or running


def test_the_job_page_shows_the_overflow_report(client, tmp_path, bob):
    job = run(bf16_model(tmp_path, extra_bits=BIG))
    client.force_login(bob)
    page = client.get(job.get_absolute_url())
    assert page.status_code == 200
    text = page.content.decode()
    assert "failed" in text and "<code>embed</code>" in text and "clamp" in text
    assert 'http-equiv="refresh"' not in text


def test_a_stale_job_shows_as_interrupted(client, tmp_path, alice):
    version = bf16_model(tmp_path)
    job = conversion_job_start(model_version=version)
    ConversionJob.objects.filter(pk=job.pk).update(
        state=ConversionState.RUNNING, lease_expires_at=timezone.now() - timedelta(seconds=5)
    )
    client.force_login(alice)
    assert b"interrupted" in client.get(job.get_absolute_url()).content
    assert b"interrupted" in client.get(version.get_absolute_url()).content


def test_a_job_no_agent_picked_up_says_so(client, tmp_path, alice, cpu_node):
    job = conversion_job_start(model_version=bf16_model(tmp_path), node=cpu_node, enqueue=False)
    ConversionJob.objects.filter(pk=job.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    client.force_login(alice)
    text = client.get(job.get_absolute_url()).content.decode()
    assert "no agent has picked it up from <code>node.local</code>" in text


def test_members_get_no_convert_form_and_cannot_post(client, tmp_path, bob, cpu_node):
    version = bf16_model(tmp_path)
    client.force_login(bob)
    assert b"Convert to fp16" not in client.get(version.get_absolute_url()).content
    response = client.post(f"/models/{version.name}/convert/", {"node": "local"})
    assert response.status_code == 302 and "/admin/login/" in response["Location"]
    assert not ConversionJob.objects.exists()


def test_the_page_explains_why_a_conversion_was_not_started(client, tmp_path, alice, cpu_node):
    version = bf16_model(tmp_path)
    conversion_job_start(model_version=version)
    client.force_login(alice)
    response = client.post(f"/models/{version.name}/convert/", {"node": "local"}, follow=True)
    assert b"Not started: conversion job" in response.content


def test_the_job_page_is_404_under_another_model(client, tmp_path, alice, qwen_bf16):
    job = conversion_job_start(model_version=bf16_model(tmp_path))
    client.force_login(alice)
    assert client.get(f"/models/{qwen_bf16.name}/conversions/{job.pk}/").status_code == 404


def test_the_admin_lists_jobs_with_progress(client, tmp_path, alice):
    job = run(bf16_model(tmp_path))
    alice.is_superuser = True
    alice.save()
    client.force_login(alice)
    assert client.get(f"/admin/registry/conversionjob/{job.pk}/change/").status_code == 200
    page = client.get("/admin/registry/conversionjob/")
    assert page.status_code == 200
    assert b"<progress" in page.content and b"qwen-bf16-fp16" in page.content


# Committed rows: the stalled workers run on their own threads and database connections.
@pytest.mark.django_db(transaction=True)
def test_a_worker_stalled_past_its_lease_registers_nothing_beside_the_second_workers_copy(tmp_path, settings):
    from tests.helpers.jobs import StalledWorker

    settings.PORTAL_CONVERSION_LEASE_S = 1
    version = bf16_model(tmp_path)
    job = conversion_job_start(model_version=version)

    def worker(name: str) -> StalledWorker:
        # Each converts, then stalls just before it registers its copy (the "registering" write).
        return StalledWorker(
            name,
            lambda worker: conversion_job_run(job_id=job.pk, worker=worker),
            pause_when=lambda fields: "phase" in fields,
        )

    first, second = worker("worker-a"), worker("worker-b")
    try:
        stalled = first.start_and_wait_stalled()
        # The second takes the job over and is about to register when the first wakes up.
        taken = second.start_and_wait_stalled(lapse=False)
        assert taken.token == stalled.token + 1
        first.resume()
        assert first.error is None
        assert not ModelVersion.objects.filter(name="qwen-bf16-fp16").exists()
        second.resume()
    finally:
        first.close()
        second.close()

    assert second.error is None
    job.refresh_from_db()
    registered = ModelVersion.objects.get(name="qwen-bf16-fp16")
    assert job.state == ConversionState.SUCCEEDED and job.result_id == registered.pk
    assert (job.attempt, job.lease_token, job.lease_owner) == (2, taken.token, "")
    assert ModelVersion.objects.count() == 2
    assert leftovers(tmp_path) == ["qwen-bf16", "qwen-bf16-fp16"]  # the first one's work directory is gone
    assert hash_model_dir(tmp_path / "qwen-bf16-fp16").weights_sha256 == registered.weights_sha256
