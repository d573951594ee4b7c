"""HTTP API for environment leases (provider cleanup protocol)."""

from django.urls import URLPattern

urlpatterns: list[URLPattern] = []
