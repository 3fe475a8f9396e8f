"""Team pages: members see their own team; staff see every team. Members manage the team's
API keys (create: shown once; list: prefix and last use; revoke) and see usage against quotas.
The team's overview (its deployments and the GPUs they hold) is a deployments page
(portal/deployments/views.py, `deployments:team-detail`)."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.shortcuts import redirect, render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_http_methods

from portal.core.charts import bar_chart_svg
from portal.core.errors import ApplicationError
from portal.core.filters import filtered

from .filters import ApiKeyFilter
from .forms import ApiKeyCreateForm
from .selectors import (
    api_key_get_for_team,
    api_keys_of,
    example_model_for_key,
    model_names_for_team,
    served_names_for_team,
    team_get_for_user,
    team_in_flight,
    usage_by_priority_class,
    usage_daily_series,
    usage_hourly_series,
    usage_today,
    usage_today_by_key,
    usage_today_by_version,
)
from .services import api_key_create, api_key_revoke


@never_cache  # the page that shows a new key must not be cached anywhere
@login_required
def team_keys(request, slug: str):
    team = team_get_for_user(request.user, slug)
    new_token = None
    context = {}
    model_names = model_names_for_team(team)
    served_names = served_names_for_team(team)
    form = ApiKeyCreateForm(request.POST or None, model_names=model_names, served_names=served_names)
    if request.method == "POST" and form.is_valid():
        try:
            key, new_token = api_key_create(team=team, created_by=request.user, **form.service_kwargs())
        except ApplicationError as error:
            field = {"allowed_models": "models"}.get(error.field, error.field)
            form.add_error(field if field in form.fields else None, error.message)
        else:
            form = ApiKeyCreateForm(model_names=model_names, served_names=served_names)
            # A model the key may call, for the snippets (issue 38: they said "MODEL").
            example = example_model_for_key(team, key.allowed_models)
            context = {
                "base_url": request.build_absolute_uri("/v1"),
                "example_model": example,
                "example_model_known": example != "MODEL",
            }
    key_filter, keys, filter_status = filtered(ApiKeyFilter, request, api_keys_of(team))
    context |= {"team": team, "keys": keys, "filter": key_filter, "form": form, "new_token": new_token}
    # The new key is rendered in this response only: never put in a message, the session or a redirect.
    return render(
        request,
        "teams/team_keys.html",
        context,
        # A refused form or filter is the client's error: 400, with the fields named on the page.
        status=400 if form.is_bound and form.errors else filter_status,
    )


@require_http_methods(["GET", "POST"])
@login_required
def team_key_revoke(request, slug: str, prefix: str):
    """GET: the confirmation page (a revoked key cannot be brought back); POST: revoke."""
    team = team_get_for_user(request.user, slug)
    key = api_key_get_for_team(team, prefix)
    if request.method == "GET":
        return render(request, "teams/key_revoke_confirm.html", {"team": team, "key": key})
    api_key_revoke(api_key=key)
    return redirect("teams:keys", slug=team.slug)


@login_required
def team_usage(request, slug: str):
    team = team_get_for_user(request.user, slug)
    today = usage_today(team)
    daily = usage_daily_series(team)
    hourly = usage_hourly_series(team)
    return render(
        request,
        "teams/team_usage.html",
        {
            "team": team,
            "today": today,
            "by_key": usage_today_by_key(team),
            "by_version": usage_today_by_version(team),
            "by_class": usage_by_priority_class(team),
            "in_flight": team_in_flight(team),
            "daily_chart": bar_chart_svg(
                [(d.strftime("%m-%d"), v) for d, v in daily],
                title="Tokens per day (last 30 days, UTC)",
                limit=team.tokens_per_day,
                limit_label="daily quota",
                label_every=5,
            ),
            "hourly_chart": bar_chart_svg(
                [(h.strftime("%H"), v) for h, v in hourly],
                title="Requests per hour (last 24 h, UTC)",
                label_every=3,
            ),
        },
    )
