"""Run against another database (DATABASE_URL) by the PostgreSQL-restart test, in a child
process: `seed N DIR` makes N runs waiting for finalization and prints their ids; `confirm`
confirms the holds whose recorded owner process is gone; `dump` prints what the checker reads,
as JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import django


def main() -> None:
    django.setup()
    from paperclip.models import BoardMembership, HeartbeatRun
    from tests.paperclip.factories import CompanyFactory, UserFactory
    from tests.paperclip.worker import test_finalization_nemesis as nemesis
    from tests.recovery.factories import make_binding

    command = sys.argv[1]
    if command == "seed":
        count, base = int(sys.argv[2]), Path(sys.argv[3])
        company = CompanyFactory()
        user = UserFactory(is_staff=True, username="restart-board")
        BoardMembership.objects.create(user=user, company=company)
        runs = [make_binding(company=company, tmp_path=base / f"r{i}").run for i in range(count)]
        print(json.dumps([str(run.pk) for run in runs]))
    elif command == "confirm":
        from django.contrib.auth import get_user_model

        user = get_user_model().objects.get(username="restart-board")
        print(nemesis._confirm_dead_owners(user))
    elif command == "dump":
        states = {str(run.pk): nemesis._state(run) for run in HeartbeatRun.objects.all()}
        ops = [
            [o.id, o.run_id, o.status, o.started_at.isoformat(), _iso(o.finished_at), o.error]
            for o in nemesis._ops()
        ]
        events = [[e.run_id, e.action, e.at.isoformat(), e.details] for e in nemesis._events()]
        print(json.dumps({"states": states, "ops": ops, "events": events}))


def _iso(value: object) -> str | None:
    return value.isoformat() if value is not None else None  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
