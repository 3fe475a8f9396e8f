"""Writes to the model registry."""

from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from inference.errors import InputError
from inference.hashing import ModelHashes, hash_model_dir
from inference.hf_config import arch_from_config
from inference.modelspec import ModelArch
from portal.core.errors import ApplicationError, clean_or_raise

from .models import ModelVersion

ARCH_FIELDS = (
    "model_type",
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
    "attention_bias",
    "max_position_embeddings",
    "weight_dtype",
    "quant_bits",
    "quant_group_size",
)


# Fields the portal derives or measures; nobody types them in.
DERIVED_FIELDS = (
    *ARCH_FIELDS,
    "quantization",
    "param_count",
    "weights_sha256",
    "tokenizer_sha256",
    "weight_files",
    "tokenizer_files",
    "hashed_at",
)


def arch_fields(arch: ModelArch) -> dict:
    fields = {name: getattr(arch, name) for name in ARCH_FIELDS}
    fields["quantization"] = arch.quantization or ""
    return fields


def parse_config(config: object) -> ModelArch:
    if not isinstance(config, dict):
        raise ApplicationError("config.json must be a JSON object", field="config")
    try:
        return arch_from_config(config)
    except InputError as error:
        raise ApplicationError(f"config.json: {error}", field="config") from error


@transaction.atomic
def model_version_create(
    *,
    name: str,
    config: dict,
    path: str = "",
    source: str = "",
    revision: str = "",
    smoke_expected_substring: str = "",
) -> ModelVersion:
    """Register a model version from its config.json (facts are derived, never typed in)."""
    arch = parse_config(config)
    version = ModelVersion(
        name=name,
        path=path,
        source=source,
        revision=revision,
        config=config,
        smoke_expected_substring=smoke_expected_substring,
        **arch_fields(arch),
    )
    clean_or_raise(version, exclude=["param_count"])
    version.save()
    return version


def model_version_record_hashes(*, model_version: ModelVersion, hashes: ModelHashes) -> ModelVersion:
    model_version.weights_sha256 = hashes.weights_sha256
    model_version.tokenizer_sha256 = hashes.tokenizer_sha256
    model_version.weight_files = hashes.weight_files
    model_version.tokenizer_files = hashes.tokenizer_files
    model_version.hashed_at = timezone.now()
    model_version.save(
        update_fields=[
            "weights_sha256",
            "tokenizer_sha256",
            "weight_files",
            "tokenizer_files",
            "hashed_at",
        ]
    )
    return model_version


def model_version_hash_files(*, model_version: ModelVersion, path: str | None = None) -> ModelVersion:
    """Hash the weights and tokenizer under `path` (default: the version's path) and record them."""
    directory = path or model_version.path
    if not directory:
        raise ApplicationError("the model version has no path to hash", field="path")
    try:
        hashes = hash_model_dir(directory)
    except InputError as error:
        raise ApplicationError.from_input_error(error) from error
    return model_version_record_hashes(model_version=model_version, hashes=hashes)
