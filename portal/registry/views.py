"""Model registry pages."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.shortcuts import get_object_or_404, render

from .models import ModelVersion


@login_required
def model_list(request):
    return render(request, "registry/model_list.html", {"models": ModelVersion.objects.all()})


@login_required
def model_detail(request, name: str):
    model = get_object_or_404(ModelVersion, name=name)
    return render(request, "registry/model_detail.html", {"model": model})
