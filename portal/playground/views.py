"""The playground: a member chats with a model their team can call, through the gateway.

The page posts (session and CSRF token, no API key) to `playground_chat`, which runs
the gateway's own pipeline (`portal.gateway.views.proxy_as`) as the member's playground
key: the same quotas, admission, routing, relay and usage as any key of the team. Its
answers are the gateway's: an SSE stream, or an OpenAI-shaped error the page shows.
"""

from __future__ import annotations

from typing import Any

from asgiref.sync import sync_to_async
from django.contrib.auth.decorators import login_required
from django.shortcuts import render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_POST

from portal.gateway.auth import caller_for_key
from portal.gateway.errors import GatewayError, error_response
from portal.gateway.views import proxy_as
from portal.registry.selectors import random_weight_model_names
from portal.teams.models import ApiKey

from . import payload
from .selectors import playground_models, playground_team_for
from .services import playground_key_for


@login_required
def playground(request, slug: str):
    team = playground_team_for(request.user, slug)
    clamp = team.max_tokens_clamp
    # Each model's bound for max_tokens (the team's clamp within its context), for the hint and the input.
    models: list[dict[str, Any]] = [
        {"name": m.name, "max_tokens": m.max_tokens(clamp), "context_bound": m.context_bound(clamp)}
        for m in playground_models(team)
    ]
    return render(
        request,
        "playground/playground.html",
        {
            "team": team,
            "models": models,
            "first_max_tokens": models[0]["max_tokens"] if models else clamp,
            "random_weight_models": random_weight_model_names([m["name"] for m in models]),
            "gateway_url": request.build_absolute_uri("/v1"),
            "max_messages": payload.MAX_MESSAGES,
            "max_message_chars": payload.MAX_MESSAGE_CHARS,
            "max_system_chars": payload.MAX_SYSTEM_CHARS,
            "max_temperature": payload.MAX_TEMPERATURE,
        },
    )


def _identity(user, slug: str, raw: bytes) -> tuple[ApiKey, bytes]:
    """(the member's playground key, the chat request) or a GatewayError 400; 404 if not a member."""
    team = playground_team_for(user, slug)
    body = payload.chat_body(raw, max_tokens_clamp=team.max_tokens_clamp)
    return playground_key_for(team=team, user=user), body


@never_cache
@require_POST
@login_required
async def playground_chat(request, slug: str):
    user = await request.auser()
    try:
        key, body = await sync_to_async(_identity)(user, slug, request.body)
    except GatewayError as error:
        return error_response(error)
    return await proxy_as(caller_for_key(key), body)
