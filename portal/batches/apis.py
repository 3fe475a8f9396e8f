"""OpenAI's Files and Batches API under `/v1/` (https://platform.openai.com/docs/api-reference/batch):
thin async views served by the gateway's ASGI application (portal/asgi.py), authenticated by the
team's key exactly as the gateway's routes are (`gateway.internal.authenticate_api`), answering
errors in OpenAI's shape. Another team's file or batch is a 404, as one that does not exist."""

from __future__ import annotations

import io
import json

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.files.uploadhandler import MemoryFileUploadHandler
from django.db import close_old_connections, transaction
from django.http import HttpResponse, JsonResponse
from django.http.multipartparser import MultiPartParser, MultiPartParserError
from django.views.decorators.csrf import csrf_exempt

from portal.core.errors import ApplicationError
from portal.core.jsonbody import TOO_DEEP
from portal.gateway.errors import GatewayError, error_response, invalid_request
from portal.gateway.internal import Caller, authenticate_api
from portal.teams.models import ApiKey, Team

from . import selectors, services
from .models import FilePurpose
from .objects import batch_object, file_object, list_object

DEFAULT_LIMIT = 20


def _not_found(kind: str, public_id: str) -> GatewayError:
    return GatewayError(404, f"No such {kind}: '{public_id[:80]}'.", code="not_found")


def _method_not_allowed(allowed: str) -> HttpResponse:
    response = error_response(GatewayError(405, f"Use {allowed}.", code="method_not_allowed"))
    response["Allow"] = allowed
    return response


async def _serve(request, allowed: str, handler, *args) -> HttpResponse:
    """Method check, key authentication, then `handler(request, caller, *args)` off the event loop."""
    if request.method not in allowed.split(", "):
        return _method_not_allowed(allowed)
    try:
        caller = await authenticate_api(request)
        return await sync_to_async(_in_database)(handler, request, caller, *args)
    except GatewayError as error:
        return error_response(error)


def _in_database(handler, request, caller: Caller, *args) -> HttpResponse:
    close_old_connections()  # the gateway handler sends no request signals (gateway/asgi.py)
    try:
        return handler(request, caller, *args)
    except ApplicationError as error:
        raise GatewayError(400, error.message, code="invalid_request", param=error.field or None) from None


def _limit(request, default: int) -> int:
    raw = request.GET.get("limit", "")
    if not raw:
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= selectors.LIST_LIMIT_MAX:
        raise invalid_request(f"`limit` must be an integer from 1 to {selectors.LIST_LIMIT_MAX}.", "limit")
    return int(raw)


def _json_body(request) -> dict:
    try:
        body = json.loads(request.body or b"{}")
    except (ValueError, UnicodeDecodeError):
        raise GatewayError(400, "The body is not valid JSON.", code="invalid_json") from None
    except RecursionError:
        raise GatewayError(400, TOO_DEEP, code="invalid_json") from None
    if not isinstance(body, dict):
        raise GatewayError(400, "The body must be a JSON object.", code="invalid_json")
    return body


# --- /v1/files --------------------------------------------------------------------------------


class _WholeInMemory(MemoryFileUploadHandler):
    """The upload is in memory already (bounded at the edge by BATCH_FILE_MAX_BYTES): keep it there."""

    def handle_raw_input(self, input_data, META, content_length, boundary, encoding=None):
        self.activated = True


def _upload(request) -> tuple[str, bytes, str]:
    """(filename, content, purpose) of a multipart upload (`file` and `purpose` fields)."""
    meta = {**request.META, "CONTENT_LENGTH": str(len(request.body))}
    if not meta.get("CONTENT_TYPE", "").startswith("multipart/form-data"):
        raise invalid_request("Upload the file as multipart/form-data (`file`, `purpose`).", "file")
    try:
        fields, files = MultiPartParser(meta, io.BytesIO(request.body), [_WholeInMemory()], "utf-8").parse()
    except (MultiPartParserError, ValueError) as error:
        raise invalid_request(f"The multipart body could not be read: {error}.", "file") from None
    upload = files.get("file")
    if upload is None:
        raise invalid_request("`file` is required.", "file", "missing_parameter")
    purpose = fields.get("purpose", "")
    if purpose != FilePurpose.BATCH:
        raise invalid_request("`purpose` must be `batch`.", "purpose")
    return upload.name or "upload.jsonl", upload.read(), purpose


def _files(request, caller: Caller) -> HttpResponse:
    if request.method == "POST":
        filename, content, purpose = _upload(request)
        team = Team.objects.get(pk=caller.team_id)
        row = services.file_create(team=team, filename=filename, content=content, purpose=purpose)
        return JsonResponse(file_object(row))
    limit = _limit(request, selectors.LIST_LIMIT_MAX)
    rows = selectors.file_list_for_team(
        team_id=caller.team_id,
        purpose=request.GET.get("purpose", ""),
        after=request.GET.get("after", ""),
        limit=limit + 1,
    )
    return JsonResponse(list_object(rows[:limit], shape=file_object, has_more=len(rows) > limit))


def _file(request, caller: Caller, file_id: str) -> HttpResponse:
    row = selectors.file_get_for_team(team_id=caller.team_id, public_id=file_id)
    if row is None:
        raise _not_found("file", file_id)
    if request.method == "DELETE":
        services.file_delete(file=row)
        return JsonResponse({"id": file_id, "object": "file", "deleted": True})
    return JsonResponse(file_object(row))


def _file_content(request, caller: Caller, file_id: str) -> HttpResponse:
    row = selectors.file_get_for_team(team_id=caller.team_id, public_id=file_id)
    if row is None:
        raise _not_found("file", file_id)
    return HttpResponse(services.file_read(file=row), content_type="application/jsonl")


@csrf_exempt
async def files(request):
    return await _serve(request, "GET, POST", _files)


@csrf_exempt
async def file_detail(request, file_id: str):
    return await _serve(request, "GET, DELETE", _file, file_id)


@csrf_exempt
async def file_content(request, file_id: str):
    return await _serve(request, "GET", _file_content, file_id)


# --- /v1/batches ------------------------------------------------------------------------------


def _batches(request, caller: Caller) -> HttpResponse:
    if request.method == "POST":
        body = _json_body(request)
        with transaction.atomic():
            batch = services.batch_create(
                team=Team.objects.get(pk=caller.team_id),
                api_key=ApiKey.objects.get(pk=caller.key_id),
                input_file_id=str(body.get("input_file_id") or ""),
                endpoint=str(body.get("endpoint") or ""),
                completion_window=str(body.get("completion_window") or ""),
                metadata=body.get("metadata"),
            )
        return JsonResponse(batch_object(batch))
    limit = _limit(request, DEFAULT_LIMIT)
    rows = selectors.batch_list_for_team(
        team_id=caller.team_id, after=request.GET.get("after", ""), limit=limit + 1
    )
    return JsonResponse(list_object(rows[:limit], shape=batch_object, has_more=len(rows) > limit))


def _batch(request, caller: Caller, batch_id: str) -> HttpResponse:
    batch = selectors.batch_get_for_team(team_id=caller.team_id, public_id=batch_id)
    if batch is None:
        raise _not_found("batch", batch_id)
    return JsonResponse(batch_object(batch))


def _batch_cancel(request, caller: Caller, batch_id: str) -> HttpResponse:
    batch = selectors.batch_get_for_team(team_id=caller.team_id, public_id=batch_id)
    if batch is None:
        raise _not_found("batch", batch_id)
    with transaction.atomic():
        batch = services.batch_cancel(batch=batch)
    batch = selectors.batch_get_for_team(team_id=caller.team_id, public_id=batch_id)
    assert batch is not None  # it was there a moment ago, and cancelling deletes nothing
    return JsonResponse(batch_object(batch))


@csrf_exempt
async def batches(request):
    return await _serve(request, "GET, POST", _batches)


@csrf_exempt
async def batch_detail(request, batch_id: str):
    return await _serve(request, "GET", _batch, batch_id)


@csrf_exempt
async def batch_cancel(request, batch_id: str):
    return await _serve(request, "POST", _batch_cancel, batch_id)


UPLOAD_OVERHEAD_BYTES = 64 * 1024  # multipart headers and boundaries around the file


def upload_limit() -> int:
    """The edge's limit for `POST /v1/files` (portal/asgi.py): the file's bound plus its envelope."""
    return settings.BATCH_FILE_MAX_BYTES + UPLOAD_OVERHEAD_BYTES
