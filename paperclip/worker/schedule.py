"""Interval settings as cron schedules (Procrastinate's periodic tasks run on cron)."""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured


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
