"""Writes to the model registry."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F, Q
from django.utils import timezone

from inference import convert
from inference.errors import InputError
from inference.hashing import ModelHashes, hash_model_dir
from inference.hf_config import arch_from_config
from inference.modelspec import ModelArch
from portal.audit.services import audit_event_record
from portal.core.errors import ApplicationError, clean_or_raise
from portal.core.jobs import Lease, LostLease, claim, lease_break, worker_name
from portal.inventory.dispatch import send_to_node

from .models import (
    ACTIVE_CONVERSION_STATES,
    SHARE_TOTAL_BP,
    ConversionJob,
    ConversionState,
    ModelVersion,
    Quantization,
    ServedModel,
    ServedModelVersion,
    WeightDtype,
    model_name_validator,
)

logger = logging.getLogger(__name__)

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
    callable_by_name: bool = True,
) -> ModelVersion:
    """Register a model version from its config.json (facts are derived, never typed in)."""
    arch = parse_config(config)
    if ServedModel.objects.filter(name=name).exists():  # the served name would hide the version
        raise ApplicationError(
            f"`{name}` is a served model name; a version's name must differ.", field="name"
        )
    version = ModelVersion(
        name=name,
        path=path,
        source=source,
        revision=revision,
        config=config,
        smoke_expected_substring=smoke_expected_substring,
        callable_by_name=callable_by_name,
        **arch_fields(arch),
    )
    clean_or_raise(version, exclude=["param_count"])
    version.save()
    return version


# An external version's architecture is unknown; these stand in for it so that the row is valid.
# `external` keeps them away from the planner and the pages show "unknown".
_EXTERNAL_ARCH = dict(
    model_type="external",
    num_layers=1,
    hidden_size=1,
    num_attention_heads=1,
    num_kv_heads=1,
    head_dim=1,
    intermediate_size=1,
    vocab_size=1,
)


@transaction.atomic
def model_version_record_external(*, name: str, max_model_len: int | None, source: str) -> ModelVersion:
    """A model version known only from a running server's `/v1/models` (`register_endpoint`)."""
    version = ModelVersion(
        name=name,
        source=source[:255],
        external=True,
        max_position_embeddings=max_model_len or 1,
        **_EXTERNAL_ARCH,
    )
    clean_or_raise(version, exclude=["param_count"])
    version.save()
    audit_event_record(
        action="model_version.record_external",
        target=version,
        changes={"source": version.source, "max_model_len": max_model_len},
    )
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


def model_version_hash_status(*, model_version: ModelVersion, status: str) -> None:
    """What the page says of the last Hash files job (one UPDATE: the agent writes it as it goes)."""
    model_version.hash_status, model_version.hash_status_at = status[:300], timezone.now()
    ModelVersion.objects.filter(pk=model_version.pk).update(
        hash_status=model_version.hash_status, hash_status_at=model_version.hash_status_at
    )


def model_version_hash_files(
    *, model_version: ModelVersion, path: str | None = None, progress: Callable | None = None
) -> ModelVersion:
    """Hash the weights and tokenizer under `path` (default: the version's path) and record them;
    `progress(relpath, bytes_done, bytes_total)` as inference.hashing calls it."""
    directory = path or model_version.path
    if not directory:
        raise ApplicationError("the model version has no path to hash", field="path")
    try:
        hashes = hash_model_dir(directory, progress=progress)
    except InputError as error:
        raise ApplicationError.from_input_error(error) from error
    return model_version_record_hashes(model_version=model_version, hashes=hashes)


def model_version_mark_simulated_release(*, model_version: ModelVersion, actor=None) -> ModelVersion:
    """Mark a version without release hashes as release-checked for simulated nodes only: the
    simulator reads nothing but the stored config.json, so there are no files to pin. A real engine
    still refuses it (rollouts: placement.check_release; starts: the agent's hash check)."""
    if model_version.external:
        raise ApplicationError(f"{model_version.name} was recorded from a running server", field="name")
    if model_version.weights_sha256:
        raise ApplicationError(f"{model_version.name} already has release hashes", field="name")
    if model_version.simulated_release_at is None:
        model_version.simulated_release_at = timezone.now()
        model_version.save(update_fields=["simulated_release_at"])
        audit_event_record(
            action="model_version.simulated_release",
            target=model_version,
            changes={"simulated_release_at": model_version.simulated_release_at.isoformat()},
            actor=actor,
        )
    return model_version


def model_version_request_hashes(*, model_version: ModelVersion, node) -> None:
    """Ask `node`'s agent to hash the files at the version's path and record them as the release.

    The files live on the node, so the hashing happens there (a 70B model is minutes of reading);
    the version's page shows the digests once the agent has written them.
    """
    if not model_version.path:
        raise ApplicationError(f"{model_version.name} has no path to its files", field="path")
    if model_version.weights_sha256:
        # The release hashes are what a start checks the files against: never overwrite them
        # from whatever the files are now (`manage.py hash_model --model` can, deliberately).
        raise ApplicationError(f"{model_version.name} already has release hashes", field="path")
    model_version_hash_status(model_version=model_version, status=f"queued on {node.name}")
    send_to_node(node, "registry.hash_model_version", args=[model_version.pk])


# --- bf16 → fp16 conversion ---------------------------------------------------------

# A hidden file in each converted directory naming the job that wrote it. Not a
# hashed file (inference.hashing ignores it). It lets a re-run recognise a
# directory that an interrupted job renamed into place but never registered.
CONVERSION_MARKER = ".portal-conversion.json"
PROGRESS_WRITE_INTERVAL_S = 0.5


# Another attempt owns the job now (our lease lapsed and someone took over, or it was superseded).
ConversionSuperseded = LostLease


def _lease_until():
    return timezone.now() + timedelta(seconds=settings.PORTAL_CONVERSION_LEASE_S)


def conversion_job_start(
    *,
    model_version: ModelVersion,
    node=None,
    new_name: str = "",
    output_path: str = "",
    clamp: bool = False,
    requested_by=None,
    enqueue: bool = True,
) -> ConversionJob:
    """Record a bf16 → fp16 conversion of `model_version` and send it to `node`'s agent.

    The files live on the node, so only facts the database knows are checked here;
    the run checks the directories. `node=None` records a job for `convert_bf16`
    to run in-process (`enqueue` is then ignored).
    """
    if model_version.weight_dtype != WeightDtype.BFLOAT16:
        raise ApplicationError(
            f"{model_version.name} has {model_version.weight_dtype} weights; only bf16 ones are converted",
            field="model_version",
        )
    if model_version.quantization != Quantization.NONE:
        raise ApplicationError(
            f"{model_version.name} is {model_version.get_quantization_display()}-quantized; "
            "its packed weights cannot be cast",
            field="model_version",
        )
    if not model_version.path:
        raise ApplicationError(f"{model_version.name} has no path to its files", field="path")
    new_name = new_name or f"{model_version.name}-fp16"
    try:
        model_name_validator(new_name)
    except Exception as error:
        raise ApplicationError(f"{new_name!r}: {model_name_validator.message}", field="name") from error
    if len(new_name) > (ModelVersion._meta.get_field("name").max_length or 0):
        raise ApplicationError("too long", field="name")
    if ModelVersion.objects.filter(name=new_name).exists():
        raise ApplicationError(f"a model version named {new_name} already exists", field="name")
    output = output_path or str(Path(model_version.path).parent / new_name)
    if not os.path.isabs(output):
        raise ApplicationError(f"{output} is not an absolute path", field="output")

    with transaction.atomic():
        _supersede_stale(output_path=output, new_name=new_name)
        try:
            with transaction.atomic():
                job = ConversionJob.objects.create(
                    source=model_version,
                    node=node,
                    new_name=new_name,
                    output_path=output,
                    clamp=clamp,
                    requested_by=requested_by,
                    # A queued job whose agent never picks it up is superseded after a lease too.
                    lease_expires_at=_lease_until(),
                )
        except IntegrityError as error:
            running = ConversionJob.objects.filter(
                Q(output_path=output) | Q(new_name=new_name), state__in=ACTIVE_CONVERSION_STATES
            ).first()
            raise ApplicationError(
                f"conversion job {running.pk if running else '?'} is already writing {new_name} ({output})",
                field="name",
            ) from error
        audit_event_record(
            action="model_version.convert_fp16",
            target=model_version,
            actor=requested_by,
            changes={
                "job": job.pk,
                "new_name": new_name,
                "node": node.name if node else None,
                "clamp": clamp,
            },
        )
        if node is not None and enqueue:
            send_to_node(node, "registry.convert_model_version", args=[job.pk])
    return job


def _supersede_stale(*, output_path: str, new_name: str) -> int:
    now = timezone.now()
    # Breaking the lease moves the token on: a worker that only stalled registers nothing when it wakes.
    return lease_break(
        ConversionJob.objects.filter(
            Q(output_path=output_path) | Q(new_name=new_name),
            state__in=ACTIVE_CONVERSION_STATES,
            lease_expires_at__lt=now,
        ),
        state=ConversionState.FAILED,
        error="interrupted: its worker stopped reporting (killed or node down); superseded by a new job",
        finished_at=now,
    )


def _claim(job_id: int, worker: str) -> Lease | None:
    """Take the job (queued, or running with a lapsed lease) with the next fencing token."""
    return claim(
        ConversionJob,
        job_id,
        worker=worker,
        ttl_s=settings.PORTAL_CONVERSION_LEASE_S,
        claimable=Q(state__in=[ConversionState.QUEUED, ConversionState.RUNNING]),
        live=Q(state=ConversionState.RUNNING),
        attempt=F("attempt") + 1,
        state=ConversionState.RUNNING,
        phase="converting",
        started_at=timezone.now(),
        error="",
    )


def _range_fields(report: convert.ConversionReport) -> dict:
    return {
        "overflow_total": report.overflow_total,
        "overflows": [
            {"file": o.file, "tensor": o.tensor, "count": o.overflow, "max_abs": o.max_abs}
            for o in report.overflows
        ],
        "nonfinite_total": report.nonfinite_total,
        "underflow_total": report.underflow_total,
    }


def _remove_orphan_target(target: Path) -> None:
    """A complete directory that an interrupted job renamed into place but never registered."""
    marker = target / CONVERSION_MARKER
    if marker.is_file() and not ModelVersion.objects.filter(path=str(target)).exists():
        logger.warning("removing %s: written by an interrupted conversion, never registered", target)
        shutil.rmtree(target)


def conversion_job_run(
    *, job_id: int, progress: Callable[[convert.ConversionProgress], None] | None = None, worker: str = ""
) -> ConversionJob:
    """Run a conversion job here (on the node holding the files), start to finish.

    A no-op for a job that is finished or that a live attempt is running. On any
    failure, including an overflow without clamp, the job ends `failed` with the
    reason and report, and nothing is left at the target or registered.
    """
    lease = _claim(job_id, worker or worker_name())
    job = ConversionJob.objects.select_related("source").get(pk=job_id)
    if lease is None:
        return job
    attempt = job.attempt  # ours: nobody else claims while the lease is live
    source = job.source
    target = Path(job.output_path)
    work = convert.partial_dir(target, f"job{job.pk}-{attempt}")
    last_write = 0.0

    def on_progress(p: convert.ConversionProgress) -> None:
        nonlocal last_write
        if progress is not None:
            progress(p)
        now = time.monotonic()
        if now - last_write >= PROGRESS_WRITE_INTERVAL_S or p.bytes_done == p.bytes_total:
            last_write = now
            lease.write(
                tensors_done=p.tensors_done,
                tensors_total=p.tensors_total,
                bytes_done=p.bytes_done,
                bytes_total=p.bytes_total,
                current_file=p.file[:500],
                overflow_total=p.overflow_total,
            )

    try:
        _remove_orphan_target(target)
        convert.check_target(source.path, target)
        convert.remove_partials(target, keep=work.name.split(convert.PARTIAL_MARK, 1)[1])
        report = convert.convert_into(source.path, work, clamp=job.clamp, progress=on_progress)
        (work / CONVERSION_MARKER).write_text(
            json.dumps({"job": job.pk, "attempt": attempt, "source": source.name, "clamp": job.clamp}) + "\n"
        )
        lease.write(phase="registering", report=report.to_dict(), **_range_fields(report))
        # The job row lock is the fence: only the attempt that owns it registers.
        with lease.fenced():
            version = model_version_create(
                name=job.new_name,
                config=report.config,
                path=str(target),
                source=source.source,
                revision=source.revision,
                smoke_expected_substring=source.smoke_expected_substring,
            )
            model_version_record_hashes(model_version=version, hashes=report.hashes())
            lease.finish(
                state=ConversionState.SUCCEEDED,
                phase="",
                result=version,
                finished_at=timezone.now(),
                tensors_done=report.tensors_total,
                bytes_done=report.bytes_total,
            )
            # Last: a failure here rolls the registration back; after it only the
            # commit remains (an orphan from a crash there is removed by a re-run).
            os.rename(work, target)
        convert.fsync_dir(target.parent)
    except ConversionSuperseded as error:
        shutil.rmtree(work, ignore_errors=True)
        logger.warning("%s", error)
    except convert.Fp16RangeError as error:
        shutil.rmtree(work, ignore_errors=True)
        _fail(lease, str(error), report=error.report.to_dict(), **_range_fields(error.report))
    except (InputError, ApplicationError) as error:
        shutil.rmtree(work, ignore_errors=True)
        message = error.message if isinstance(error, ApplicationError) else str(error)
        _fail(lease, message)
    except BaseException as error:
        shutil.rmtree(work, ignore_errors=True)
        _fail(lease, f"{type(error).__name__}: {error}")
        raise
    return ConversionJob.objects.get(pk=job.pk)


def _fail(lease: Lease, message: str, **fields) -> None:
    # A failure after the job was taken over is the old worker's, not the job's: nothing is written.
    with contextlib.suppress(LostLease):
        lease.finish(
            state=ConversionState.FAILED, phase="", error=message, finished_at=timezone.now(), **fields
        )


# --- Served model names (docs/decisions.md, "Served model names and traffic shares") ----------------


def _check_shares(shares: dict[str, int]) -> None:
    if not shares:
        raise ApplicationError("A served model needs at least one version.", field="versions")
    for name, share in shares.items():
        if not isinstance(share, int) or isinstance(share, bool) or not 0 <= share <= SHARE_TOTAL_BP:
            raise ApplicationError(
                f"The share of `{name}` must be a whole number of basis points from 0 to {SHARE_TOTAL_BP}.",
                field="versions",
            )
    total = sum(shares.values())
    if total != SHARE_TOTAL_BP:
        raise ApplicationError(
            f"The shares add up to {total / 100:g} %, not 100 %.", field="versions", extra={"total_bp": total}
        )


def _versions_named(names: list[str]) -> dict[str, ModelVersion]:
    found = {v.name: v for v in ModelVersion.objects.filter(name__in=names)}
    missing = sorted(set(names) - set(found))
    if missing:
        raise ApplicationError(f"No model version named {', '.join(missing)}.", field="versions")
    return found


@transaction.atomic
def served_model_create(
    *, name: str, shares: dict[str, int], description: str = "", actor=None
) -> ServedModel:
    """A stable name over model versions; `shares`: version name → basis points, adding up to 10000."""
    _check_shares(shares)
    if ModelVersion.objects.filter(name=name).exists():
        raise ApplicationError(
            f"`{name}` is a model version's name; a served name must differ.", field="name"
        )
    served = ServedModel(name=name, description=description)
    clean_or_raise(served)
    served.save()
    versions = _versions_named(list(shares))
    ServedModelVersion.objects.bulk_create(
        ServedModelVersion(served_model=served, model_version=versions[n], share_bp=share)
        for n, share in shares.items()
    )
    audit_event_record(
        action="served_model.create", target=served, changes={"shares_bp": shares}, actor=actor
    )
    return served


@transaction.atomic
def served_model_set_shares(
    *, served_model: ServedModel, shares: dict[str, int], actor=None, reason: str = ""
) -> dict[str, int]:
    """Set every version's share at once (versions not named leave the served model). The row is
    locked, so two writers (a rollout step and an operator) apply one after the other, never mixed.
    Returns the shares before."""
    _check_shares(shares)
    ServedModel.objects.select_for_update().get(pk=served_model.pk)
    before = {
        row.model_version.name: row.share_bp for row in served_model.versions.select_related("model_version")
    }
    versions = _versions_named(list(shares))
    served_model.versions.exclude(model_version__name__in=list(shares)).delete()
    for name, share in shares.items():
        ServedModelVersion.objects.update_or_create(
            served_model=served_model, model_version=versions[name], defaults={"share_bp": share}
        )
    ServedModel.objects.filter(pk=served_model.pk).update(updated_at=timezone.now())
    if before != shares:
        audit_event_record(
            action="served_model.set_shares",
            target=served_model,
            changes={"before_bp": before, "after_bp": shares, "reason": reason},
            actor=actor,
        )
    return before
