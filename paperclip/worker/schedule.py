"""Interval settings as cron schedules (Procrastinate's periodic tasks run on cron), and the one
decorator every periodic maintenance task is declared with."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from procrastinate.contrib.django import app


def cron_every(seconds: int, *, setting: str) -> str:
    """The cron schedule that fires every `seconds`: a divisor of 60 runs on the seconds field
    (Procrastinate's sixth cron field), whole minutes dividing an hour on the minutes field.
    Anything else cannot be one execution per period on every worker alike, so it is refused
    at start-up, naming the setting."""
    if 1 <= seconds <= 60 and 60 % seconds == 0:
        return "* * * * *" if seconds == 60 else f"* * * * * */{seconds}"
    minutes, rest = divmod(seconds, 60)
    if rest == 0 and 1 <= minutes <= 60 and 60 % minutes == 0:
        return f"*/{minutes} * * * *" if minutes < 60 else "0 * * * *"
    raise ImproperlyConfigured(
        f"{setting}={seconds}: use a number of seconds that divides a minute (1..60) or a "
        "whole number of minutes that divides an hour (120, 300, 600, 900, 1800, 3600)."
    )


def maintenance_task(
    name: str, *, every: str | None = None, cron: str | None = None, pass_context: bool = False
) -> Callable[[Callable[..., Any]], Any]:
    """A periodic task of the maintenance queue (docs/worker.md#tasks), named `name` as a task,
    as a periodic schedule and as its queueing lock (so at most one run of it waits): every
    `settings.<every>` seconds (refused at start-up unless `cron_every` accepts it), or on
    `cron`."""
    if (every is None) == (cron is None):
        raise ValueError("give exactly one of every= and cron=")
    schedule = cron or cron_every(getattr(settings, str(every)), setting=str(every))

    def decorate(func: Callable[..., Any]) -> Any:
        options: dict[str, Any] = {"name": name, "queue": "maintenance", "queueing_lock": name}
        if pass_context:
            task = app.task(**options, pass_context=True)(func)
        else:
            task = app.task(**options)(func)
        return app.periodic(cron=schedule, periodic_id=name)(task)

    return decorate
