"""The renewal cadence the console shows beside a lease's owner (no database)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from leases.renewal import duration, renewal_cadence

RENEWED = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def test_an_owner_renewing_on_time_is_not_late() -> None:
    cadence = renewal_cadence(
        age=timedelta(seconds=12), renewed_at=RENEWED, expires_at=RENEWED + timedelta(seconds=60)
    )
    assert cadence.text == "last renewal 12 s ago, expected every 20 s (TTL 60 s)"
    assert cadence.short == "12 s ago, every 20 s"
    assert cadence.missed == 0


def test_an_owner_that_stopped_renewing_is_late_by_the_renewals_it_missed() -> None:
    cadence = renewal_cadence(
        age=timedelta(seconds=65), renewed_at=RENEWED, expires_at=RENEWED + timedelta(seconds=60)
    )
    assert cadence.missed == 3
    assert cadence.text.endswith("; late: 3 renewals missed")


def test_a_renewal_a_little_late_is_not_called_late() -> None:
    cadence = renewal_cadence(
        age=timedelta(seconds=29), renewed_at=RENEWED, expires_at=RENEWED + timedelta(seconds=60)
    )
    assert cadence.missed == 0


def test_clock_skew_never_shows_a_negative_age() -> None:
    cadence = renewal_cadence(
        age=timedelta(seconds=-3), renewed_at=RENEWED, expires_at=RENEWED + timedelta(seconds=60)
    )
    assert cadence.short == "0 s ago, every 20 s"


def test_durations_read_in_seconds_then_minutes_then_hours() -> None:
    assert duration(timedelta(seconds=119)) == "119 s"
    assert duration(timedelta(minutes=17, seconds=5)) == "17 min"
    assert duration(timedelta(hours=3, minutes=30)) == "3.5 h"


def test_a_lease_expired_by_hand_has_no_interval_to_show() -> None:
    cadence = renewal_cadence(age=timedelta(seconds=5), renewed_at=RENEWED, expires_at=RENEWED)
    assert cadence.short == "5 s ago, every ?"
    assert cadence.text == "last renewal 5 s ago, expected every ? (no TTL left)"
