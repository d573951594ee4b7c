# Paperclip control plane: `make run` for a local server, `make test` for the checks CI runs.
# Without DATABASE_URL, every manage.py process starts or joins an embedded PostgreSQL in
# $(PAPERCLIP_DATA_DIR)/pgdata (default .data/pgdata); see docs/setup.md.

SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=
# make test: pytest-xdist worker processes, each on its own test database (0: one process).
# More workers than cores pays here: many tests wait on servers, processes and locks.
PYTEST_WORKERS ?= 4
BENCH_ARGS ?=
# make chaos: seconds of load, and extra arguments for tests/chaos/run.py (--agents N ...).
DURATION ?= 600
CHAOS_ARGS ?=
# Set to 1 to accept pytest's exit code 5 ("no tests ran") as success.
PYTEST_NO_TESTS_OK ?=

.PHONY: help run demo-reset test lint bench fuzz chaos mutate clean clean-data

help:
	@echo "make run        create .venv if needed, migrate, seed demo data, serve on $(HOST):$(PORT)"
	@echo "                with one worker (Ctrl-C stops both)"
	@echo "make demo-reset delete the demo company and seed it afresh: every demo state back"
	@echo "make test       ruff, ruff format --check, mypy, then pytest on PYTEST_WORKERS=$(PYTEST_WORKERS)"
	@echo "                processes (extra args: PYTEST_ARGS=...; docs/testing.md)"
	@echo "make lint       ruff, ruff format --check, mypy (and mypy --strict on clients/python)"
	@echo "make bench      run bench/leases.py, bench/checkpoints.py, bench/finalize.py,"
	@echo "                bench/copyback.py, bench/renew_load.py, bench/scale.py, bench/snapshots.py,"
	@echo "                bench/registration.py, bench/history.py, bench/cas_sync.py,"
	@echo "                bench/cli_start.py,"
	@echo "                bench/snapshots.py --cas s3, bench/snapshots.py --scale"
	@echo "                (BENCH_ARGS=...)"
	@echo "make fuzz       the schema-driven fuzz tests with more cases (FUZZ_EXAMPLES=$(FUZZ_EXAMPLES))"
	@echo "make chaos      runtime-lease chaos test, DURATION=600 seconds (CHAOS_ARGS=...), with"
	@echo "                PostgreSQL failovers and a web node cut off (a cluster and a network"
	@echo "                namespace of its own: root); prints the checker's figures"
	@echo "make mutate     mutmut over the safety-critical modules, one group at a time, niced"
	@echo "                (MUTATE_ARGS=leases|recovery|checkpoints|cleanup ...; docs/testing.md)"
	@echo "make clean      remove .venv and tool caches (keeps .data, the local database)"
	@echo "make clean-data stop the embedded PostgreSQL and delete .data"

# The interpreter is only looked for when .venv is missing.
$(PY):
	@py=$$(scripts/find-python.sh) || exit 1; \
	echo "Creating $(VENV) with $$py"; \
	"$$py" -m venv $(VENV)

# Reinstall only when a pyproject.toml changed since the last install. The agent client
# (clients/python) is its own distribution; installing it provides .venv/bin/paperclip-agent.
$(STAMP): pyproject.toml clients/python/pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e '.[dev]' -e clients/python
	@touch $@

# The demo's runs are copied back from their directories in the data directory's demo/
# (docs/security.md#the-legacy-copy-back): the legacy copy-back is off unless roots are set.
run demo-reset: export PAPERCLIP_COPYBACK_ROOTS ?= $(abspath $(or $(PAPERCLIP_DATA_DIR),.data))/demo
DEMO_LOGINS = $$($(PY) -c "from paperclip.datadir import data_dir; print(data_dir() / 'demo' / 'logins.txt')")

run: $(STAMP)
	$(PY) manage.py migrate --noinput
	$(PY) manage.py seed_demo --url http://$(HOST):$(PORT)
	@echo "Serving on http://$(HOST):$(PORT)/  (admin: /admin/, API docs: /api/docs/) with one worker"
	@echo "(finalizations and the periodic tasks on their normal schedule; more: manage.py run_worker)."
	@echo "Logins and commands above, saved in $(DEMO_LOGINS). Ctrl-C stops both."
	DJANGO_DEBUG=$${DJANGO_DEBUG:-true} \
	$(PY) scripts/run_dev.py $(PY) $(HOST):$(PORT)

# Every seeded state back: the demo company is deleted and seeded afresh (new logins).
demo-reset: $(STAMP)
	$(PY) manage.py migrate --noinput
	$(PY) manage.py seed_demo --reset --url http://$(HOST):$(PORT)
	@echo "Logins and commands above: $(DEMO_LOGINS)"

# mypy's Django plugin loads settings but never connects; a placeholder DATABASE_URL keeps it
# from starting the embedded server, which mypy's exit (no atexit) would leave running.
lint: $(STAMP)
	@rc=0; \
	$(PY) -m ruff check . || rc=1; \
	$(PY) -m ruff format --check . || rc=1; \
	DATABASE_URL=$${DATABASE_URL:-postgres://mypy@localhost/mypy} $(PY) -m mypy . || rc=1; \
	$(PY) -m mypy --strict --config-file clients/python/pyproject.toml clients/python/paperclip_client || rc=1; \
	exit $$rc

# Lint and tests both run, whatever the other's outcome; either failing fails the target.
test: $(STAMP)
	@lint=0; $(MAKE) --no-print-directory lint || lint=$$?; \
	tests=0; $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS) || tests=$$?; \
	if [ "$$tests" = 5 ] && [ -n "$(PYTEST_NO_TESTS_OK)" ]; then \
		echo "pytest collected no tests (accepted: PYTEST_NO_TESTS_OK is set)"; tests=0; \
	fi; \
	echo "make test: lint $$([ $$lint = 0 ] && echo ok || echo FAILED)," \
	     "pytest $$([ $$tests = 0 ] && echo ok || echo "FAILED (exit $$tests)")"; \
	[ "$$lint" = 0 ] && [ "$$tests" = 0 ]

# The same tests `make test` runs, with many more generated cases per operation.
FUZZ_EXAMPLES ?= 150
fuzz: $(STAMP)
	PAPERCLIP_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -p no:logging tests/fuzz $(PYTEST_ARGS)

bench: $(STAMP)
	@for f in bench/leases.py bench/checkpoints.py bench/finalize.py bench/copyback.py bench/renew_load.py bench/scale.py bench/snapshots.py bench/registration.py bench/history.py bench/cas_sync.py bench/cli_start.py; do \
		if [ -f "$$f" ]; then echo "== $$f"; $(PY) "$$f" $(BENCH_ARGS) || exit 1; \
		else echo "skip $$f (not written yet)"; fi; \
	done
	@echo "== bench/snapshots.py --cas s3"; $(PY) bench/snapshots.py --cas s3 $(BENCH_ARGS)
	@echo "== bench/snapshots.py --scale"; $(PY) bench/snapshots.py --scale $(BENCH_ARGS)

chaos: $(STAMP)
	$(PY) -m tests.chaos.run --duration $(DURATION) $(CHAOS_ARGS)

# Mutation testing of the safety-critical modules (docs/testing.md); not in CI. Needs
# DATABASE_URL. Niced: it keeps one core busy for a long while.
MUTATE_ARGS ?=
mutate: $(STAMP)
	nice -n 10 $(PY) scripts/mutate.py $(MUTATE_ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache build *.egg-info
	find . -path ./.data -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

clean-data:
	@if [ -x $(PY) ]; then \
		$(PY) -c 'import os, pathlib; from paperclip.db.embedded import embedded_server_stop as stop; \
print("stopped embedded PostgreSQL" if stop(pathlib.Path(os.environ.get("PAPERCLIP_DATA_DIR", ".data"))) else "no embedded PostgreSQL running")'; \
	fi
	rm -rf $${PAPERCLIP_DATA_DIR:-.data}
