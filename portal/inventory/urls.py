from django.urls import path

from . import views

app_name = "inventory"
urlpatterns = [
    path("", views.node_list_view, name="node-list"),
    # Before a node's own page (nodes:detail): "new" is not a node name (NodeCreateForm refuses it).
    path("new/", views.node_new, name="node-new"),
]
