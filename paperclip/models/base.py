"""The abstract base every timestamped model of the project builds on (the other apps' too)."""

from __future__ import annotations

from django.db import models
from django.db.models.functions import Now


class TimestampedModel(models.Model):
    created_at = models.DateTimeField(db_default=Now(), editable=False)
    updated_at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        abstract = True
