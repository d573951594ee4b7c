"""HTTP API of the checkpoints app."""

from django.urls import URLPattern

urlpatterns: list[URLPattern] = []
