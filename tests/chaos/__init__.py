"""Chaos test of the runtime-lease system.

A multi-worker gunicorn serves agent OS processes that claim, renew, write fenced operations
and release runtime leases, while a nemesis kills and pauses agents, terminates database
backends, kills gunicorn workers and ends the holders' issues. Every agent request and
response goes to a JSONL history, every fault to a faults log; `checker.check` judges them
together with a final read of the database.

- `agent.py`: one agent process (standard library only).
- `nemesis.py`: the fault injector, a thread of the runner.
- `checker.py`: the pure checker over histories, faults and the final database read.
- `run.py`: sets everything up, runs it, checks, prints the figures
  (`python -m tests.chaos.run --duration S --agents N --workspaces W --seed X`).
"""
