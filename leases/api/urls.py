"""HTTP API of the leases app."""

from django.urls import URLPattern

urlpatterns: list[URLPattern] = []
