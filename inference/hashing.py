"""Release hashes of a model directory: one digest for the weights, one for the tokenizer.

In production a tokenizer was updated without its weights and the service produced
intermittently garbled output for weeks. So a release records the SHA-256 of every
weight file and every tokenizer file, and a launch compares the directory on the
node against that record and refuses, naming the files, when they differ.

Two groups, hashed separately so a report can say which half drifted:

- weights: the tensor files (`*.safetensors`, `*.bin`, `*.pt`, `*.pth`, `*.gguf`),
  their shard indexes, and the files that say how to read them: `config.json`
  (shapes, rope scaling, `quantization_config`) and AutoGPTQ/AutoAWQ's separate
  `quantize_config.json` / `quant_config.json`. An edited config.json over unchanged
  tensors changes what the model computes just as silently as a swapped tokenizer,
  and the planner itself reads config.json, so it belongs to the release.
- tokenizer: the files that map text to token ids and back, plus the chat template
  (newer transformers moved it out of tokenizer_config.json into its own file).

Everything else (README, LICENSE, generation_config.json's sampling defaults,
.gitattributes, anything under a hidden directory such as .git or .cache) is not
hashed: changing it cannot garble output, and it changes for harmless reasons.

A group's digest is the SHA-256 of its sorted "relpath\\tsha256\\n" lines, so it does
not depend on walk order and a renamed file changes it. A model that ships no
tokenizer files gets "" as its tokenizer digest rather than the hash of an empty
list, so "no tokenizer" is visible as such in a stored record.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inference.errors import InputError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
WEIGHT_INDEX_SUFFIXES = (".safetensors.index.json", ".bin.index.json")
WEIGHT_CONFIG_NAMES = frozenset({"config.json", "quantize_config.json", "quant_config.json"})
# transformers' Trainer leaves its pickled arguments next to fine-tuned weights on
# the hub; it is a .bin but no part of the model.
NOT_WEIGHT_NAMES = frozenset({"training_args.bin"})
TOKENIZER_NAMES = frozenset(
    {
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer.model",
        "special_tokens_map.json",
        "vocab.json",
        "merges.txt",
        "added_tokens.json",
        "vocab.txt",
        "spiece.model",
        "chat_template.json",
        "chat_template.jinja",
    }
)

ProgressCallback = Callable[[str, int, int], None]


@dataclass(frozen=True)
class ModelHashes:
    """Digests of a model directory; file maps are relative POSIX path → sha256."""

    weights_sha256: str
    tokenizer_sha256: str
    weight_files: dict[str, str] = field(default_factory=dict)
    tokenizer_files: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "weights_sha256": self.weights_sha256,
            "tokenizer_sha256": self.tokenizer_sha256,
            "weight_files": dict(self.weight_files),
            "tokenizer_files": dict(self.tokenizer_files),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelHashes:
        """Rebuild from `to_dict()` output, e.g. a release record stored as JSON."""
        if not isinstance(data, Mapping):
            raise InputError("hashes", f"must be an object, got {type(data).__name__}")
        values: dict[str, Any] = {}
        for key in ("weights_sha256", "tokenizer_sha256"):
            if not isinstance(data.get(key), str):
                raise InputError(key, "missing from the release hashes")
            values[key] = data[key]
        for key in ("weight_files", "tokenizer_files"):
            files = data.get(key, {})
            if not isinstance(files, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in files.items()
            ):
                raise InputError(key, "must map relative paths to sha256 strings")
            values[key] = dict(files)
        return cls(**values)


def sha256_file(path: str | Path, chunk_size: int = 1 << 20) -> str:
    """Hex SHA-256 of a file, read in chunks: weight shards are many gigabytes."""
    if chunk_size <= 0:
        raise InputError("chunk_size", f"must be positive, got {chunk_size}")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()


def group_digest(files: Mapping[str, str]) -> str:
    """Digest of a file group; "" for an empty group (see the module docstring)."""
    if not files:
        return ""
    lines = "".join(f"{name}\t{sha}\n" for name, sha in sorted(files.items()))
    return hashlib.sha256(lines.encode("utf-8")).hexdigest()


def classify(relpath: str) -> str | None:
    """Return "weights", "tokenizer" or None (not hashed) for a path relative to the model dir."""
    name = relpath.rsplit("/", 1)[-1].lower()
    if name in TOKENIZER_NAMES:
        return "tokenizer"
    if name in NOT_WEIGHT_NAMES:
        return None
    if name in WEIGHT_CONFIG_NAMES or name.endswith(WEIGHT_SUFFIXES + WEIGHT_INDEX_SUFFIXES):
        return "weights"
    return None


def hash_model_dir(path: str | Path, progress: ProgressCallback | None = None) -> ModelHashes:
    """Hash the weight and tokenizer files of a model directory.

    `progress(relpath, bytes_done, bytes_total)` is called after each file, with
    byte counts over all hashed files, so the last call has bytes_done == bytes_total
    (unless a file changed size while being read).
    """
    root = Path(path)
    if not root.exists():
        raise InputError("path", f"{root} not found")
    if not root.is_dir():
        raise InputError("path", f"{root} is not a directory")

    groups: dict[str, list[str]] = {"weights": [], "tokenizer": []}
    for relpath in _walk(root):
        kind = classify(relpath)
        if kind is not None:
            groups[kind].append(relpath)
    if not any(_is_tensor_file(p) for p in groups["weights"]):
        # Name everything that is missing at once: fixing the weights only to learn of the
        # tokenizer next is a second download.
        also = "" if groups["tokenizer"] else " and no tokenizer files (tokenizer.json, tokenizer.model, …)"
        raise InputError(
            "path",
            f"missing weights{' and tokenizer' if also else ''}: no weight files "
            f"({', '.join('*' + s for s in WEIGHT_SUFFIXES)}){also} in {root}",
        )

    todo = groups["weights"] + groups["tokenizer"]
    try:
        total = sum((root / p).stat().st_size for p in todo)
        done = 0
        digests: dict[str, str] = {}
        for relpath in todo:
            digests[relpath] = sha256_file(root / relpath)
            done += (root / relpath).stat().st_size
            if progress is not None:
                progress(relpath, done, total)
    except OSError as e:
        # A dangling symlink (an interrupted download into the HF cache) or a
        # permission problem: say which file rather than crash.
        raise InputError("path", f"cannot read {e.filename}: {e.strerror}") from e

    weight_files = {p: digests[p] for p in groups["weights"]}
    tokenizer_files = {p: digests[p] for p in groups["tokenizer"]}
    return ModelHashes(
        weights_sha256=group_digest(weight_files),
        tokenizer_sha256=group_digest(tokenizer_files),
        weight_files=weight_files,
        tokenizer_files=tokenizer_files,
    )


def compare_hashes(expected: ModelHashes | Mapping[str, Any], actual: ModelHashes) -> list[str]:
    """Human-readable differences between a release record and a directory's hashes.

    Empty when they match. Each line names a file: changed, missing or unexpected.
    If `expected` holds only the two digests (no file lists), a line can only say
    which group differs.
    """
    if not isinstance(expected, ModelHashes):
        expected = ModelHashes.from_dict(expected)
    problems: list[str] = []
    for label, want_digest, got_digest, want_files, got_files in (
        (
            "weight",
            expected.weights_sha256,
            actual.weights_sha256,
            expected.weight_files,
            actual.weight_files,
        ),
        (
            "tokenizer",
            expected.tokenizer_sha256,
            actual.tokenizer_sha256,
            expected.tokenizer_files,
            actual.tokenizer_files,
        ),
    ):
        if want_digest == got_digest:
            continue
        if group_digest(want_files) == want_digest:
            problems.extend(_file_differences(label, want_files, got_files))
        else:
            # The record's file list is absent or does not add up to its digest, so
            # per-file lines would be guesses: only the group is known to differ.
            problems.append(
                f"{label} digest differs: expected {_short(want_digest)}, got {_short(got_digest)}"
            )
    return problems


def _file_differences(label: str, want: Mapping[str, str], got: Mapping[str, str]) -> list[str]:
    lines = []
    for name in sorted(want.keys() | got.keys()):
        if name not in got:
            lines.append(f"{label} file missing: {name}")
        elif name not in want:
            lines.append(f"unexpected {label} file: {name}")
        elif want[name] != got[name]:
            lines.append(
                f"{label} file changed: {name} (expected {_short(want[name])}, got {_short(got[name])})"
            )
    return lines


def _short(digest: str) -> str:
    return digest[:12] if digest else "(none)"


def _is_tensor_file(relpath: str) -> bool:
    return relpath.lower().endswith(WEIGHT_SUFFIXES)


def _walk(root: Path) -> list[str]:
    """Relative POSIX paths of the files under root, skipping hidden directories.

    Hidden directories are tool state (.git, and the .cache/huggingface that
    `huggingface-cli download --local-dir` leaves behind), not the model. Symlinked
    files are followed: the Hugging Face cache stores snapshots as links to blobs.
    """
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        rel_dir = Path(dirpath).relative_to(root)
        for name in sorted(filenames):
            found.append((rel_dir / name).as_posix())
    return found
