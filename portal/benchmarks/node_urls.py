"""A node's own page, under /nodes/ beside the inventory's list (portal/benchmarks/node_views.py)."""

from django.urls import path

from . import node_views
from .acceptance import views as acceptance_views

app_name = "nodes"
urlpatterns = [
    path("<str:name>/", node_views.node_detail, name="detail"),
    path("<str:name>/accept/", acceptance_views.node_accept, name="accept"),
    path("<str:name>/ask/<slug:what>/", node_views.node_agent_request_view, name="agent-request"),
    path(
        "<str:name>/gpus/<int:index>/mark-healthy/", node_views.gpu_mark_healthy_view, name="gpu-mark-healthy"
    ),
]
