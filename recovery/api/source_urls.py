"""HTTP API for recovery-source inspection (board)."""

from django.urls import URLPattern

urlpatterns: list[URLPattern] = []
