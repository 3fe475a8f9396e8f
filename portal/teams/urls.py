from django.urls import path

from . import views

app_name = "teams"
urlpatterns = [path("<slug:slug>/", views.team_detail, name="detail")]
