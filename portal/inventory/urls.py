from django.urls import path

from . import views

app_name = "inventory"
urlpatterns = [
    path("", views.node_list_view, name="node-list"),
    # Before <name>/: "new" is not a node name (NodeCreateForm refuses it).
    path("new/", views.node_new, name="node-new"),
    path("<str:name>/", views.node_detail, name="node-detail"),
    path("<str:name>/accept/", views.node_accept, name="node-accept"),
]
