"""HTTP API of the recovery app."""

from django.urls import URLPattern

urlpatterns: list[URLPattern] = []
