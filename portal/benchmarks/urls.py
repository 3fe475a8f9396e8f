from django.urls import path

from . import views

app_name = "benchmarks"
urlpatterns = [
    path("", views.run_list, name="run-list"),
    path("new/", views.run_new, name="run-new"),
    path("import/", views.run_import, name="run-import"),
    path("compare/", views.run_compare, name="run-compare"),
    path("deployment/<slug:deployment>/", views.run_list, name="deployment-history"),
    path("profile/<slug:profile>/", views.run_list, name="profile-history"),
    path("<int:pk>/", views.run_detail, name="run-detail"),
    path("<int:pk>/progress.json", views.run_progress, name="run-progress"),
    path("<int:pk>/cancel/", views.run_cancel, name="run-cancel"),
    path("<int:pk>/apply-cap/", views.run_apply_cap, name="run-apply-cap"),
    path("<int:pk>/export.json", views.run_export_json, name="run-export-json"),
    path("<int:pk>/export.csv", views.run_export_csv_view, name="run-export-csv"),
]
