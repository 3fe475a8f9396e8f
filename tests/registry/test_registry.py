"""Model versions: facts from config.json, hashes from the files."""

import json

import pytest
from django.core.management import CommandError, call_command

from portal.core.errors import ApplicationError
from portal.core.redis.client import redis_keys
from portal.registry.models import ModelVersion
from portal.registry.services import model_version_create
from tests.helpers.clients import api_client
from tests.helpers.samples import bundled_config

pytestmark = pytest.mark.django_db


def test_it_derives_the_architecture_and_parameter_count_from_config(llama7b):
    assert llama7b.num_layers == 32
    assert llama7b.num_kv_heads == 32
    assert llama7b.head_dim == 128
    assert abs(llama7b.param_count - 6.74e9) / 6.74e9 < 0.01


def test_it_reads_quantization_from_a_gptq_config(db):
    version = model_version_create(
        name="gemma-2-27b-it-gptq-4bit", config=bundled_config("gemma-2-27b-it-gptq-4bit")
    )
    assert (version.quantization, version.quant_bits, version.quant_group_size) == ("gptq", 4, 128)
    assert version.tie_word_embeddings


def test_it_names_the_missing_field_of_a_malformed_config_and_saves_nothing(db):
    config = bundled_config("llama-2-7b-chat-hf")
    del config["num_attention_heads"]
    with pytest.raises(ApplicationError) as error:
        model_version_create(name="broken", config=config)
    assert "num_attention_heads" in error.value.message
    assert not ModelVersion.objects.exists()


def test_it_accepts_dotted_served_model_names(db):
    version = model_version_create(
        name="llama-3.1-70b-instruct-gptq-4bit", config=bundled_config("llama-3.1-70b-instruct-gptq-4bit")
    )
    assert version.get_absolute_url() == "/models/llama-3.1-70b-instruct-gptq-4bit/"


def test_it_registers_through_the_api_for_staff(alice):
    response = api_client(alice).post(
        "/api/v1/model-versions/",
        {"name": "m1", "config": bundled_config("qwen2.5-7b-instruct")},
        format="json",
    )
    assert response.status_code == 201, response.json()
    assert response.json()["weight_dtype"] == "bfloat16"
    assert response.json()["attention_bias"] is True


def test_it_answers_400_naming_the_field_for_a_config_that_is_not_an_object(alice):
    response = api_client(alice).post(
        "/api/v1/model-versions/", {"name": "m1", "config": [1, 2]}, format="json"
    )
    assert response.status_code == 400
    assert "config" in response.json()
    assert not ModelVersion.objects.exists()


def test_it_fetches_a_dotted_name_through_the_api(bob, db):
    model_version_create(name="qwen2.5-7b-instruct", config=bundled_config("qwen2.5-7b-instruct"))
    response = api_client(bob).get("/api/v1/model-versions/qwen2.5-7b-instruct/")
    assert response.status_code == 200
    assert response.json()["num_layers"] == 28


def _fake_model_dir(tmp_path, tokenizer: bytes = b'{"model": {}}'):
    (tmp_path / "config.json").write_text(json.dumps(bundled_config("llama-2-7b-chat-hf")))
    (tmp_path / "model-00001-of-00001.safetensors").write_bytes(b"\x00" * (3 << 20))
    (tmp_path / "tokenizer.json").write_bytes(tokenizer)
    return tmp_path


def test_it_hashes_a_model_dir_and_records_it_on_the_version(tmp_path, llama7b, capsys):
    call_command("hash_model", str(_fake_model_dir(tmp_path)), "--model", llama7b.name)
    out = capsys.readouterr().out
    llama7b.refresh_from_db()
    assert len(llama7b.weights_sha256) == 64
    assert llama7b.weights_sha256 in out
    assert llama7b.tokenizer_sha256 in out
    assert "model-00001-of-00001.safetensors" in llama7b.weight_files


def test_it_changes_only_the_tokenizer_digest_when_the_tokenizer_changes(tmp_path, capsys):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    call_command("hash_model", str(_fake_model_dir(first)), "--json")
    a = json.loads(capsys.readouterr().out)
    call_command("hash_model", str(_fake_model_dir(second, tokenizer=b'{"model": {"changed": 1}}')), "--json")
    b = json.loads(capsys.readouterr().out)
    assert a["weights_sha256"] == b["weights_sha256"]
    assert a["tokenizer_sha256"] != b["tokenizer_sha256"]


def test_it_says_clearly_when_the_directory_does_not_exist(tmp_path):
    with pytest.raises(CommandError, match="path"):
        call_command("hash_model", str(tmp_path / "missing"))


def test_it_registers_and_hashes_from_the_command_line_or_not_at_all(tmp_path, capsys):
    model_dir = _fake_model_dir(tmp_path)
    call_command("register_model", "--name", "tiny", "--path", str(model_dir), "--hash")
    version = ModelVersion.objects.get(name="tiny")
    assert version.weights_sha256
    (model_dir / "model-00001-of-00001.safetensors").unlink()
    with pytest.raises(CommandError):
        call_command("register_model", "--name", "tiny2", "--path", str(model_dir), "--hash")
    assert not ModelVersion.objects.filter(name="tiny2").exists()


def test_staff_ask_the_node_holding_the_files_to_record_the_release_hashes(
    tmp_path, alice, client, settings, django_capture_on_commit_callbacks
):
    import redis

    from portal.inventory.services import node_create
    from portal.registry.tasks import hash_model_version

    node = node_create(name="hash-node", hostname="127.0.0.1")
    broker = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    queue = redis_keys().celery_key(node.queue)
    broker.delete(queue)
    version = model_version_create(
        name="llama-local", config=bundled_config("llama-2-7b-chat-hf"), path=str(_fake_model_dir(tmp_path))
    )
    client.force_login(alice)
    page = client.get(f"/models/{version.name}/").content.decode()
    assert "Hash files" in page and "not hashed" in page

    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(f"/models/{version.name}/hash/", {"node": node.name}, follow=True)
    assert "The agent on hash-node is hashing" in response.content.decode()
    messages = broker.lrange(queue, 0, -1)
    assert len(messages) == 1
    headers = json.loads(messages[0])["headers"]
    assert headers["task"] == "registry.hash_model_version" and headers["argsrepr"] == f"[{version.pk}]"

    # What the agent on hash-node does with the message.
    assert len(hash_model_version(version.pk)) == 64
    version.refresh_from_db()
    assert "model-00001-of-00001.safetensors" in version.weight_files
    page = client.get(f"/models/{version.name}/").content.decode()
    assert version.weights_sha256 in page and "Hash files" not in page
    # Release hashes are never overwritten from the page.
    response = client.post(f"/models/{version.name}/hash/", {"node": node.name}, follow=True)
    assert "already has release hashes" in response.content.decode()
    broker.delete(queue)


def test_a_member_cannot_ask_for_hashes(tmp_path, bob, client):
    version = model_version_create(
        name="llama-local", config=bundled_config("llama-2-7b-chat-hf"), path=str(tmp_path)
    )
    client.force_login(bob)
    assert "Hash files" not in client.get(f"/models/{version.name}/").content.decode()
    response = client.post(f"/models/{version.name}/hash/", {"node": "x"})
    assert response.status_code == 302 and "/admin/login/" in response["Location"]


@pytest.fixture
def adopted_version(db):
    from portal.registry.services import model_version_record_external

    return model_version_record_external(name="private-7b", max_model_len=4096, source="http://10.9.8.7:8001")


def test_a_member_does_not_read_an_adopted_engines_url_through_the_api(bob, adopted_version):
    listed = api_client(bob).get("/api/v1/model-versions/").json()
    one = api_client(bob).get("/api/v1/model-versions/private-7b/").json()
    assert "10.9.8.7" not in json.dumps(listed)
    assert one["source"] == ""


def test_a_member_does_not_read_an_adopted_engines_url_on_the_model_pages(client, bob, adopted_version):
    client.force_login(bob)
    assert "10.9.8.7" not in client.get("/models/").content.decode()
    assert "10.9.8.7" not in client.get("/models/private-7b/").content.decode()


def test_it_refuses_release_hashes_typed_into_the_api_with_400_naming_the_button(alice):
    response = api_client(alice).post(
        "/api/v1/model-versions/",
        {"name": "m1", "config": bundled_config("qwen2.5-7b-instruct"), "weights_sha256": "a" * 64,
         "weight_files": {"model.safetensors": "a" * 64}},
        format="json",
    )  # fmt: skip
    assert response.status_code == 400
    body = response.json()
    assert set(body) == {"weights_sha256", "weight_files"}
    assert "Hash files" in body["weights_sha256"][0]
    assert not ModelVersion.objects.exists()


def test_hash_model_warns_of_a_directory_without_a_tokenizer(tmp_path, llama7b, capsys):
    model_dir = _fake_model_dir(tmp_path)
    (model_dir / "tokenizer.json").unlink()
    call_command("hash_model", str(model_dir), "--model", llama7b.name)
    err = capsys.readouterr().err
    assert "warning: no tokenizer files" in err
    assert "a rollout needs release hashes of both the weights and the tokenizer" in err


def test_hash_model_names_both_missing_parts_of_an_empty_directory(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CommandError, match="missing weights and tokenizer"):
        call_command("hash_model", str(tmp_path))


def test_the_version_page_follows_a_hash_files_job_from_queued_to_done_or_why_not(
    tmp_path, alice, client, django_capture_on_commit_callbacks
):
    from portal.inventory.services import node_create
    from portal.registry.tasks import hash_model_version

    node = node_create(name="hash-node-2", hostname="127.0.0.1")
    model_dir = _fake_model_dir(tmp_path)
    version = model_version_create(
        name="llama-job", config=bundled_config("llama-2-7b-chat-hf"), path=str(model_dir)
    )
    client.force_login(alice)
    with django_capture_on_commit_callbacks(execute=True):
        client.post(f"/models/{version.name}/hash/", {"node": node.name})
    page = client.get(f"/models/{version.name}/").content.decode()
    assert "Last hashing job: queued on hash-node-2" in page
    assert '<meta http-equiv="refresh" content="5">' in page  # it follows the job

    hash_model_version(version.pk)
    version.refresh_from_db()
    assert version.hash_status == "hashed: 3 files"
    page = client.get(f"/models/{version.name}/").content.decode()
    assert "Last hashing job: hashed: 3 files" in page and 'content="5"' not in page

    empty = model_version_create(
        name="llama-empty", config=bundled_config("llama-2-7b-chat-hf"), path=str(tmp_path / "none")
    )
    (tmp_path / "none").mkdir()
    hash_model_version(empty.pk)
    page = client.get(f"/models/{empty.name}/").content.decode()
    assert "Last hashing job: not hashed: missing weights and tokenizer" in page
