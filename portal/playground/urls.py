from django.urls import path

from . import views

app_name = "playground"
urlpatterns = [
    path("<slug:slug>/playground/", views.playground, name="page"),
    path("<slug:slug>/playground/chat", views.playground_chat, name="chat"),
]
