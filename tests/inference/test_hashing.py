"""Release hashes of model directories: what is hashed, how digests behave, how drift is reported."""

from __future__ import annotations

import hashlib
import os

import pytest

from inference.errors import InputError
from inference.hashing import (
    ModelHashes,
    classify,
    compare_hashes,
    hash_model_dir,
    sha256_file,
)

# Bytes standing in for a small model; the content is irrelevant, only that it is fixed.
MODEL_FILES = {
    "model-00001-of-00002.safetensors": b"shard one" * 100,
    "model-00002-of-00002.safetensors": b"shard two" * 100,
    "model.safetensors.index.json": b'{"weight_map": {}}',
    "config.json": b'{"model_type": "llama"}',
    "tokenizer.json": b'{"model": {"vocab": {"a": 0}}}',
    "tokenizer_config.json": b'{"bos_token": "<s>"}',
    "special_tokens_map.json": b'{"eos_token": "</s>"}',
    "generation_config.json": b'{"temperature": 0.6}',
    "README.md": b"# a model\n",
}


def make_model(root, files=None, order=None):
    files = MODEL_FILES if files is None else files
    root.mkdir(parents=True, exist_ok=True)
    for name in order or files:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(files[name])
    return root


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --- sha256_file --------------------------------------------------------------------


def test_it_streams_a_file_larger_than_the_chunk_to_the_same_digest(tmp_path):
    data = os.urandom(10_000)
    path = tmp_path / "big.bin"
    path.write_bytes(data)
    assert sha256_file(path, chunk_size=1024) == sha(data)


def test_it_hashes_an_empty_file(tmp_path):
    path = tmp_path / "empty.bin"
    path.write_bytes(b"")
    assert sha256_file(path) == sha(b"")


def test_it_rejects_a_zero_chunk_size(tmp_path):
    path = tmp_path / "x.bin"
    path.write_bytes(b"x")
    with pytest.raises(InputError) as caught:
        sha256_file(path, chunk_size=0)
    assert caught.value.field == "chunk_size"


# --- classification ---------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "model.safetensors",
        "pytorch_model-00001-of-00002.bin",
        "consolidated.00.pth",
        "model.pt",
        "llama-7b.Q4_K_M.gguf",
        "model.safetensors.index.json",
        "pytorch_model.bin.index.json",
        "config.json",
        "quantize_config.json",
    ],
)
def test_it_classifies_weight_files(name):
    assert classify(name) == "weights"


@pytest.mark.parametrize(
    "name",
    [
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer.model",
        "special_tokens_map.json",
        "vocab.json",
        "merges.txt",
        "added_tokens.json",
        "vocab.txt",
        "spiece.model",
        "chat_template.jinja",
        "original/tokenizer.model",
    ],
)
def test_it_classifies_tokenizer_files(name):
    assert classify(name) == "tokenizer"


@pytest.mark.parametrize(
    "name", ["README.md", "generation_config.json", "LICENSE", ".gitattributes", "training_args.bin"]
)
def test_it_ignores_other_files(name):
    assert classify(name) is None


# --- hash_model_dir ---------------------------------------------------------------


def test_it_records_each_weight_file_with_its_sha256(tmp_path):
    hashes = hash_model_dir(make_model(tmp_path / "m"))
    assert hashes.weight_files == {
        "config.json": sha(MODEL_FILES["config.json"]),
        "model-00001-of-00002.safetensors": sha(MODEL_FILES["model-00001-of-00002.safetensors"]),
        "model-00002-of-00002.safetensors": sha(MODEL_FILES["model-00002-of-00002.safetensors"]),
        "model.safetensors.index.json": sha(MODEL_FILES["model.safetensors.index.json"]),
    }


def test_it_records_each_tokenizer_file_with_its_sha256(tmp_path):
    hashes = hash_model_dir(make_model(tmp_path / "m"))
    assert hashes.tokenizer_files == {
        name: sha(MODEL_FILES[name])
        for name in ("special_tokens_map.json", "tokenizer.json", "tokenizer_config.json")
    }


def test_it_digests_a_group_as_sha256_over_sorted_path_tab_hash_lines(tmp_path):
    hashes = hash_model_dir(make_model(tmp_path / "m"))
    lines = "".join(f"{name}\t{digest}\n" for name, digest in sorted(hashes.tokenizer_files.items()))
    assert hashes.tokenizer_sha256 == sha(lines.encode())


def test_it_gives_the_same_digests_whatever_the_creation_order(tmp_path):
    forward = hash_model_dir(make_model(tmp_path / "a"))
    backward = hash_model_dir(make_model(tmp_path / "b", order=list(reversed(MODEL_FILES))))
    assert (forward.weights_sha256, forward.tokenizer_sha256) == (
        backward.weights_sha256,
        backward.tokenizer_sha256,
    )


def test_it_changes_only_the_tokenizer_digest_when_the_tokenizer_changes(tmp_path):
    before = hash_model_dir(make_model(tmp_path / "a"))
    after = hash_model_dir(make_model(tmp_path / "b", {**MODEL_FILES, "tokenizer.json": b'{"vocab": "new"}'}))
    assert after.weights_sha256 == before.weights_sha256
    assert after.tokenizer_sha256 != before.tokenizer_sha256


def test_it_changes_the_weights_digest_when_config_json_changes(tmp_path):
    before = hash_model_dir(make_model(tmp_path / "a"))
    after = hash_model_dir(make_model(tmp_path / "b", {**MODEL_FILES, "config.json": b'{"rope_scaling": 8}'}))
    assert after.weights_sha256 != before.weights_sha256


def test_it_changes_the_digest_when_a_file_is_renamed(tmp_path):
    # Same bytes under another tokenizer name: the per-file hashes are unchanged.
    renamed = {k: v for k, v in MODEL_FILES.items() if k != "tokenizer.json"}
    renamed["tokenizer.model"] = MODEL_FILES["tokenizer.json"]
    before = hash_model_dir(make_model(tmp_path / "a"))
    after = hash_model_dir(make_model(tmp_path / "b", renamed))
    assert after.tokenizer_sha256 != before.tokenizer_sha256


def test_it_ignores_readme_and_generation_config(tmp_path):
    before = hash_model_dir(make_model(tmp_path / "a"))
    edited = {**MODEL_FILES, "README.md": b"# edited\n", "generation_config.json": b'{"temperature": 1.0}'}
    after = hash_model_dir(make_model(tmp_path / "b", edited))
    assert after == before


def test_it_skips_hidden_directories(tmp_path):
    files = {**MODEL_FILES, ".cache/huggingface/download/model.safetensors": b"partial download"}
    hashes = hash_model_dir(make_model(tmp_path / "m", files))
    assert not any(name.startswith(".") for name in hashes.weight_files)


def test_it_hashes_files_in_subdirectories_by_posix_relative_path(tmp_path):
    files = {**MODEL_FILES, "original/tokenizer.model": b"sentencepiece"}
    hashes = hash_model_dir(make_model(tmp_path / "m", files))
    assert hashes.tokenizer_files["original/tokenizer.model"] == sha(b"sentencepiece")


def test_it_follows_symlinked_files_as_in_the_hf_cache(tmp_path):
    blob = tmp_path / "blobs" / "abc123"
    blob.parent.mkdir()
    blob.write_bytes(b"shard one" * 100)
    files = {k: v for k, v in MODEL_FILES.items() if k != "model-00001-of-00002.safetensors"}
    model = make_model(tmp_path / "m", files)
    (model / "model-00001-of-00002.safetensors").symlink_to(blob)
    assert hash_model_dir(model) == hash_model_dir(make_model(tmp_path / "plain"))


def test_it_gives_an_empty_tokenizer_digest_when_there_are_no_tokenizer_files(tmp_path):
    hashes = hash_model_dir(make_model(tmp_path / "m", {"model.safetensors": b"weights"}))
    assert (hashes.tokenizer_sha256, hashes.tokenizer_files) == ("", {})


def test_it_reports_progress_per_file_up_to_the_total(tmp_path):
    calls = []
    hash_model_dir(
        make_model(tmp_path / "m"), progress=lambda name, done, total: calls.append((name, done, total))
    )
    hashed_bytes = sum(
        len(data) for name, data in MODEL_FILES.items() if name not in ("README.md", "generation_config.json")
    )
    assert len(calls) == 7
    assert calls[-1][1:] == (hashed_bytes, hashed_bytes)


def test_it_reports_progress_that_never_goes_backwards(tmp_path):
    done = []
    hash_model_dir(make_model(tmp_path / "m"), progress=lambda name, d, total: done.append(d))
    assert done == sorted(done)


def test_it_rejects_a_missing_directory(tmp_path):
    with pytest.raises(InputError, match="not found") as caught:
        hash_model_dir(tmp_path / "absent")
    assert caught.value.field == "path"


def test_it_rejects_a_file_given_as_the_directory(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"w")
    with pytest.raises(InputError, match="not a directory") as caught:
        hash_model_dir(path)
    assert caught.value.field == "path"


def test_it_rejects_a_directory_without_weight_files(tmp_path):
    files = {"config.json": b"{}", "tokenizer.json": b"{}", "model.safetensors.index.json": b"{}"}
    with pytest.raises(InputError, match=r"no weight files \(\*\.safetensors") as caught:
        hash_model_dir(make_model(tmp_path / "m", files))
    assert caught.value.field == "path"


def test_it_reports_a_dangling_symlink_as_unreadable(tmp_path):
    model = make_model(tmp_path / "m")
    (model / "model-00003-of-00003.safetensors").symlink_to(tmp_path / "blobs" / "gone")
    with pytest.raises(InputError, match="cannot read") as caught:
        hash_model_dir(model)
    assert caught.value.field == "path"


# --- ModelHashes and compare_hashes ---------------------------------------------------


def test_it_round_trips_hashes_through_a_dict(tmp_path):
    hashes = hash_model_dir(make_model(tmp_path / "m"))
    assert ModelHashes.from_dict(hashes.to_dict()) == hashes


def test_it_finds_no_differences_between_identical_directories(tmp_path):
    release = hash_model_dir(make_model(tmp_path / "a"))
    assert compare_hashes(release.to_dict(), hash_model_dir(make_model(tmp_path / "b"))) == []


def test_it_names_a_changed_tokenizer_file(tmp_path):
    release = hash_model_dir(make_model(tmp_path / "a")).to_dict()
    drifted = hash_model_dir(make_model(tmp_path / "b", {**MODEL_FILES, "tokenizer.json": b"{}"}))
    old, new = sha(MODEL_FILES["tokenizer.json"])[:12], sha(b"{}")[:12]
    assert compare_hashes(release, drifted) == [
        f"tokenizer file changed: tokenizer.json (expected {old}, got {new})"
    ]


def test_it_names_a_missing_weight_file(tmp_path):
    release = hash_model_dir(make_model(tmp_path / "a"))
    files = {k: v for k, v in MODEL_FILES.items() if k != "model-00002-of-00002.safetensors"}
    partial = hash_model_dir(make_model(tmp_path / "b", files))
    assert compare_hashes(release, partial) == ["weight file missing: model-00002-of-00002.safetensors"]


def test_it_names_an_unexpected_file(tmp_path):
    release = hash_model_dir(make_model(tmp_path / "a"))
    extra = hash_model_dir(make_model(tmp_path / "b", {**MODEL_FILES, "added_tokens.json": b"{}"}))
    assert compare_hashes(release, extra) == ["unexpected tokenizer file: added_tokens.json"]


def test_it_says_which_digest_differs_when_the_record_has_no_file_lists(tmp_path):
    release = hash_model_dir(make_model(tmp_path / "a"))
    drifted = hash_model_dir(make_model(tmp_path / "b", {**MODEL_FILES, "tokenizer.json": b"{}"}))
    digests_only = {"weights_sha256": release.weights_sha256, "tokenizer_sha256": release.tokenizer_sha256}
    old, new = release.tokenizer_sha256[:12], drifted.tokenizer_sha256[:12]
    assert compare_hashes(digests_only, drifted) == [f"tokenizer digest differs: expected {old}, got {new}"]


def test_it_rejects_a_release_record_without_digests(tmp_path):
    actual = hash_model_dir(make_model(tmp_path / "m"))
    with pytest.raises(InputError) as caught:
        compare_hashes({"weight_files": {}}, actual)
    assert caught.value.field == "weights_sha256"
