"""How an owner keeps its runtime lease: "last renewal 12 s ago, expected every 20 s", for the
console wherever a lease's owner is shown. Plain functions: no database (the age comes from
`leases.selectors.with_renewal_age`, measured with database time)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

# The clients renew a runtime lease at this fraction of the TTL the server granted
# (`renew_fraction` of the Python client's keepers, clients/python/README.md); the server
# itself only knows the TTL, so the interval shown is what a well-behaved owner does.
CLIENT_RENEW_FRACTION = 1 / 3
# Renewals come a little late under load: an owner is called late only past this many intervals.
LATE_AFTER_INTERVALS = 1.5


@dataclass(frozen=True, slots=True)
class RenewalCadence:
    age: timedelta  # since the last renewal (or the claim)
    ttl: timedelta  # the TTL of that renewal: expires_at - renewed_at
    every: timedelta  # what the clients do: ttl * CLIENT_RENEW_FRACTION

    @property
    def missed(self) -> int:
        """Renewals a well-behaved owner would have made since the last one (0 when not late)."""
        if self.every <= timedelta(0) or self.age <= self.every * LATE_AFTER_INTERVALS:
            return 0
        return int(self.age / self.every)

    @property
    def short(self) -> str:
        return f"{duration(self.age)} ago, every {self._every}"

    @property
    def text(self) -> str:
        late = f"; late: {self.missed} renewals missed" if self.missed else ""
        if self.ttl <= timedelta(0):  # expiry moved to or before the renewal (an expire)
            return f"last renewal {duration(self.age)} ago, expected every ? (no TTL left)"
        return (
            f"last renewal {duration(self.age)} ago, expected every {self._every} "
            f"(TTL {duration(self.ttl)}){late}"
        )

    @property
    def _every(self) -> str:
        return duration(self.every) if self.every > timedelta(0) else "?"


def renewal_cadence(
    *, age: timedelta, renewed_at: datetime, expires_at: datetime
) -> RenewalCadence:
    ttl = max(expires_at - renewed_at, timedelta(0))
    return RenewalCadence(age=max(age, timedelta(0)), ttl=ttl, every=ttl * CLIENT_RENEW_FRACTION)


def duration(value: timedelta) -> str:
    """`42 s` under two minutes, then `17 min`, then `3.5 h`."""
    seconds = value.total_seconds()
    if seconds < 120:
        return f"{int(seconds)} s"
    if seconds < 7200:
        return f"{int(seconds // 60)} min"
    return f"{seconds / 3600:.1f} h"
