"""Batch pages: members see their team's batches (progress, why one waits, cancel, the output and
error files); staff see every team's and pause or resume all batch work. Thin: reads in selectors
and load.py, writes in services."""

from __future__ import annotations

from django.contrib.admin.views.decorators import staff_member_required
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from portal.core.errors import ApplicationError
from portal.teams.selectors import team_get_for_user

from . import selectors, services
from .load import batch_rows

PAGE_LIMIT = 100


@login_required
def batch_list(request, slug: str):
    team = team_get_for_user(request.user, slug)
    rows = batch_rows(selectors.batch_list_for_team(team_id=team.pk, limit=PAGE_LIMIT))
    return render(request, "batches/batch_list.html", {"team": team, "rows": rows})


def _batch(request, slug: str, batch_id: str):
    team = team_get_for_user(request.user, slug)
    batch = selectors.batch_get_for_team(team_id=team.pk, public_id=batch_id)
    if batch is None:
        raise Http404("No such batch in this team.")
    return team, batch


@login_required
def batch_detail(request, slug: str, batch_id: str):
    team, batch = _batch(request, slug, batch_id)
    (row,) = batch_rows([batch])
    counts = selectors.batch_line_counts(batch_id=batch.pk)
    return render(request, "batches/batch_detail.html", {"team": team, "row": row, "counts": counts})


@require_POST
@login_required
def batch_cancel(request, slug: str, batch_id: str):
    team, batch = _batch(request, slug, batch_id)
    try:
        services.batch_cancel(batch=batch)
    except ApplicationError as error:
        return render(
            request,
            "batches/batch_detail.html",
            {"team": team, "row": batch_rows([batch])[0], "counts": None, "error": error.message},
            status=400,
        )
    return redirect("batches:detail", slug=team.slug, batch_id=batch.public_id)


@login_required
def batch_file(request, slug: str, batch_id: str, kind: str):
    """The batch's output or error file, as a download."""
    _, batch = _batch(request, slug, batch_id)
    file = {"output": batch.output_file, "errors": batch.error_file}.get(kind)
    if file is None:
        raise Http404("This batch has no such file (yet).")
    response = HttpResponse(services.file_read(file=file), content_type="application/jsonl")
    response["Content-Disposition"] = f'attachment; filename="{batch.public_id}-{kind}.jsonl"'
    return response


@staff_member_required
def staff_batches(request):
    """Every team's batches, and the switch that pauses all batch work."""
    if request.method == "POST":
        paused = request.POST.get("action") == "pause"
        services.batches_pause_set(paused=paused, by=request.user.get_username())
        return redirect("batches:staff")
    rows = batch_rows(list(selectors.batch_list_all(limit=PAGE_LIMIT)))
    return render(request, "batches/staff_batches.html", {"rows": rows, "paused": selectors.batches_paused()})
