"""Django settings for llmgw, all taken from the environment through the registry in
`llmgw_site.config` (the Configuration table of docs/configuration.md is printed from it).

Unset DATABASE_URL means SQLite in LLMGW_HOME; unset REDIS_URL means embedded mode,
with in-process channel layer, endpoint list, usage store and activation queue.
"""

import math
import os
import secrets
import shlex
from pathlib import Path

import dj_database_url
import django_stubs_ext
from django.core.exceptions import ImproperlyConfigured
from platformdirs import user_data_dir

from llmgw_site.config import setting
from telemetry import TracingConfigError, exporter_name

# Django's generic classes (ModelAdmin[Model], QuerySet[Model]) subscriptable at run time, as their types are written.
django_stubs_ext.monkeypatch()

BASE_DIR = Path(__file__).resolve().parent.parent
# State (the SQLite file, the secret key, the demo's credentials) lives in LLMGW_HOME: by default `var/` in a source
# checkout, and the user's data folder (e.g. ~/.local/share/llmgw) for an installed package, never site-packages.
_DEFAULT_HOME = BASE_DIR / "var" if (BASE_DIR / "manage.py").exists() else Path(user_data_dir("llmgw", appauthor=False))
VAR_DIR = Path(setting("LLMGW_HOME") or _DEFAULT_HOME)
if (_old_home := setting("LLMGW_VAR_DIR")) is not None:
    # Ignoring it would start embedded mode on a new, empty SQLite file elsewhere: the fleet would seem gone.
    raise ImproperlyConfigured(
        f"LLMGW_VAR_DIR was renamed LLMGW_HOME: set LLMGW_HOME={_old_home} and unset LLMGW_VAR_DIR"
    )

DEBUG = setting("DEBUG")
DATABASE_URL = setting("DATABASE_URL")
REDIS_URL = setting("REDIS_URL") or None
EMBEDDED = REDIS_URL is None


def _secret_key() -> str:
    key = setting("SECRET_KEY")
    if key:
        return key
    if DATABASE_URL is None:
        # Embedded mode on one box: a random key kept beside the SQLite file,
        # so sessions survive restarts without a shared, guessable default.
        VAR_DIR.mkdir(parents=True, exist_ok=True)
        path = VAR_DIR / "secret_key"
        if not path.exists():
            path.write_text(secrets.token_urlsafe(50))
            path.chmod(0o600)
        return path.read_text().strip()
    raise ImproperlyConfigured("SECRET_KEY must be set when DATABASE_URL is set")


SECRET_KEY = _secret_key()
# Where `manage.py up` listens; allowed as a Host header by default.
LLMGW_HOST = setting("LLMGW_HOST")
# ALLOWED_HOSTS replaces the default list (as before); LLMGW_ALLOWED_HOSTS adds to whichever is in force,
# so a deployment names its public host without restating the local ones.
ALLOWED_HOSTS = setting("ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]", LLMGW_HOST]) + setting(
    "LLMGW_ALLOWED_HOSTS"
)
CSRF_TRUSTED_ORIGINS = setting("CSRF_TRUSTED_ORIGINS") + setting("LLMGW_CSRF_TRUSTED_ORIGINS")
# When set, /metrics on the control plane and on routers needs `Authorization: Bearer <token>`.
LLMGW_METRICS_TOKEN = setting("LLMGW_METRICS_TOKEN")
# TLS of the control plane as `up` serves it; with a client CA, agents need a node certificate
# (agentlink/tls.py). A separate uvicorn is given the same files on its command line.
LLMGW_TLS_CERT_FILE = setting("LLMGW_TLS_CERT_FILE")
LLMGW_TLS_KEY_FILE = setting("LLMGW_TLS_KEY_FILE")
LLMGW_TLS_CLIENT_CA_FILE = setting("LLMGW_TLS_CLIENT_CA_FILE")
for _name in ("LLMGW_TLS_CERT_FILE", "LLMGW_TLS_KEY_FILE", "LLMGW_TLS_CLIENT_CA_FILE"):
    _path = globals()[_name]
    if _path and not os.access(_path, os.R_OK):
        raise ImproperlyConfigured(f"{_name}={_path!r} is not a readable file")
if LLMGW_TLS_KEY_FILE and not LLMGW_TLS_CERT_FILE:
    raise ImproperlyConfigured("LLMGW_TLS_KEY_FILE is set but LLMGW_TLS_CERT_FILE is not")
# What `enrol_node --print-command` tells a new node: where the control plane is, and the CA to trust.
LLMGW_AGENT_CONTROL_PLANES = setting("LLMGW_AGENT_CONTROL_PLANES")
LLMGW_AGENT_CA_FILE = setting("LLMGW_AGENT_CA_FILE")

INSTALLED_APPS = [
    "dashboard.apps.FleetAdminConfig",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_prometheus",
    "catalog",
    "inventory",
    "reconciler",
    "keys",
    "teams",
    "router",
    "dashboard",
    "agentlink",
    "runner",
    "llmgw_site",  # for `manage.py settings_table`
]

MIDDLEWARE = [
    "django_prometheus.middleware.PrometheusBeforeMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_prometheus.middleware.PrometheusAfterMiddleware",
]

ROOT_URLCONF = "llmgw_site.urls"
ASGI_APPLICATION = "llmgw_site.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
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

if DATABASE_URL:
    try:
        # Connections are kept a minute and checked before reuse, so a database restart costs no request.
        DATABASES = {"default": dj_database_url.parse(DATABASE_URL, conn_max_age=60, conn_health_checks=True)}
    except Exception as exc:  # dj-database-url raises several types for bad URLs
        raise ImproperlyConfigured(f"DATABASE_URL is not a valid database URL: {exc}") from None
else:
    VAR_DIR.mkdir(parents=True, exist_ok=True)
    DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": str(VAR_DIR / "llmgw.sqlite3")}}

if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # The ticker, the agent consumer and admin write from different threads:
    # WAL and IMMEDIATE transactions turn lock upgrades into short waits.
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {
            "timeout": 20,
            "transaction_mode": "IMMEDIATE",
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        }
    )
    # Tests use a file too: SQLite's shared in-memory cache answers "table is locked"
    # at once to concurrent writers instead of waiting, unlike the file llmgw runs on.
    DATABASES["default"].setdefault("TEST", {}).setdefault("NAME", str(VAR_DIR / "test.sqlite3"))

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
# Static files are served from the apps by WhiteNoise; collectstatic is optional.
STATIC_ROOT = setting("STATIC_ROOT")
WHITENOISE_USE_FINDERS = True
WHITENOISE_AUTOREFRESH = DEBUG


# Read here, not only into CHANNEL_LAYERS: the agent consumer renews memberships against it.
LLMGW_CHANNEL_GROUP_EXPIRY_SECONDS = setting("LLMGW_CHANNEL_GROUP_EXPIRY_SECONDS")


def channel_layers(redis_url: str | None) -> dict:
    """The channel layer: in-process when embedded, Redis otherwise."""
    if redis_url is None:
        return {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    # channels-redis blocks 5 s in BZPOPMIN per receive; redis-py's default socket
    # timeout is also 5 s, which would kill every idle consumer. Give reads headroom.
    host = {"address": redis_url, "socket_timeout": 30, "socket_connect_timeout": 5}
    return {
        "default": {
            # hub.channel_layer: a blocking pool, group delivery the sender hears about, batched receive.
            "BACKEND": "hub.channel_layer.FleetChannelLayer",
            "CONFIG": {
                "hosts": [host],
                "prefix": "llmgw:asgi",
                "capacity": setting("LLMGW_CHANNEL_CAPACITY"),
                "group_expiry": LLMGW_CHANNEL_GROUP_EXPIRY_SECONDS,
                "pool_size": setting("LLMGW_REDIS_POOL_SIZE"),
                "pool_timeout": setting("LLMGW_REDIS_POOL_TIMEOUT_SECONDS"),
            },
        }
    }


CHANNEL_LAYERS = channel_layers(REDIS_URL)

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "dashboard.api.auth.TokenOrBearerAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAdminUser"],
    "DEFAULT_PAGINATION_CLASS": "dashboard.api.pagination.BoundedLimitOffsetPagination",
    "PAGE_SIZE": 100,
    "DEFAULT_SCHEMA_CLASS": "dashboard.api.schema.ApiAutoSchema",
    # JSON bodies only: one documented shape per write (forms would be a second, untyped one).
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
}
SPECTACULAR_SETTINGS = {
    "TITLE": "llmgw API",
    "DESCRIPTION": "Operate the fleet: status summary, models (with aliases and profiles), nodes, replicas, "
    "API keys and token usage. Staff only: a token (`Authorization: Bearer …`) or an admin session.",
    "VERSION": "1",
    # The schema and its Swagger UI are staff-only, like the API (drf-spectacular's default is anyone).
    "SERVE_PERMISSIONS": ["rest_framework.permissions.IsAdminUser"],
    "COMPONENT_SPLIT_REQUEST": True,
    # drf-spectacular's own hook, then: input strings refuse NUL and bodies unknown keys, as the API does.
    "POSTPROCESSING_HOOKS": ["drf_spectacular.hooks.postprocess_schema_enums", "dashboard.api.schema.strict_input"],
    # Swagger UI's scripts, styles and icon from the project's own static files, not a CDN: most GPU
    # clusters have no internet, and the page was blank there.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
}

# --- llmgw -------------------------------------------------------------------
LLMGW_PORT = setting("LLMGW_PORT")
LLMGW_ROUTER_PORT = setting("LLMGW_ROUTER_PORT")
# Seconds between reconcile ticks (Celery beat in distributed mode).
LLMGW_TICK_SECONDS = setting("LLMGW_TICK_SECONDS")
LLMGW_LEASE_NAME = "reconciler"
LLMGW_LEASE_TTL_SECONDS = setting("LLMGW_LEASE_TTL_SECONDS")
LLMGW_HEARTBEAT_SECONDS = setting("LLMGW_HEARTBEAT_SECONDS")
LLMGW_LLAMA_SERVER = setting("LLMGW_LLAMA_SERVER")
# Blank: the agents' own default (agent/engines/vllm_command.py), the cached CPU build or `vllm serve`.
LLMGW_VLLM_COMMAND = setting("LLMGW_VLLM_COMMAND")
# A node drain starts a replacement first; the old replica is drained once it is ready, or after this long.
LLMGW_DRAIN_REPLACEMENT_WAIT_SECONDS = setting("LLMGW_DRAIN_REPLACEMENT_WAIT_SECONDS")
LLMGW_UNREACHABLE_AFTER_SECONDS = setting("LLMGW_UNREACHABLE_AFTER_SECONDS")
LLMGW_LOST_AFTER_SECONDS = setting("LLMGW_LOST_AFTER_SECONDS")
# An unhealthy GPU must report healthy this long before it is used again.
LLMGW_GPU_QUARANTINE_SECONDS = setting("LLMGW_GPU_QUARANTINE_SECONDS")
# A shard still "assigned" (start sent, no answer) this long gets its start command again.
LLMGW_START_RESEND_SECONDS = setting("LLMGW_START_RESEND_SECONDS")
LLMGW_COMMAND_RESEND_SECONDS = setting("LLMGW_COMMAND_RESEND_SECONDS")
LLMGW_COMMAND_RESEND_BATCH = setting("LLMGW_COMMAND_RESEND_BATCH")
# Weights no profile uses are removed from the nodes' disks after a grace period (reconciler.weights.sweep).
LLMGW_WEIGHTS_SWEEP_GRACE_SECONDS = setting("LLMGW_WEIGHTS_SWEEP_GRACE_SECONDS")
LLMGW_WEIGHTS_SWEEP_SECONDS = setting("LLMGW_WEIGHTS_SWEEP_SECONDS")
LLMGW_WEIGHTS_SWEEP_BATCH = setting("LLMGW_WEIGHTS_SWEEP_BATCH")
LLMGW_STAGE_ENGINES = setting("LLMGW_STAGE_ENGINES")
if unknown := sorted(set(LLMGW_STAGE_ENGINES) - {"vllm", "sglang", "mock"}):
    raise ImproperlyConfigured(
        f"LLMGW_STAGE_ENGINES names {', '.join(unknown)}: only vllm, sglang and mock load hub weights that can be staged"
    )
LLMGW_STAGE_STALL_SECONDS = setting("LLMGW_STAGE_STALL_SECONDS")
LLMGW_STAGE_PEER_COPIES = setting("LLMGW_STAGE_PEER_COPIES")
LLMGW_LAST_SEEN_FLUSH_SECONDS = setting("LLMGW_LAST_SEEN_FLUSH_SECONDS")
LLMGW_HEARTBEAT_RECHECK_SECONDS = setting("LLMGW_HEARTBEAT_RECHECK_SECONDS")
LLMGW_SHARD_START_TIMEOUT_SECONDS = setting("LLMGW_SHARD_START_TIMEOUT_SECONDS")
LLMGW_BACKOFF_BASE_SECONDS = setting("LLMGW_BACKOFF_BASE_SECONDS")
LLMGW_BACKOFF_MAX_SECONDS = setting("LLMGW_BACKOFF_MAX_SECONDS")
# A replica ready this long has its failure count reset: the next failure backs off from the base again.
LLMGW_BACKOFF_RESET_SECONDS = setting("LLMGW_BACKOFF_RESET_SECONDS")
LLMGW_ENGINE_PORT_RANGE = setting("LLMGW_ENGINE_PORT_RANGE")
# A port an agent found taken by another program is not given to that host again for this long.
LLMGW_BUSY_PORT_SECONDS = setting("LLMGW_BUSY_PORT_SECONDS")
# How long the router holds a request for a model that is starting.
LLMGW_ACTIVATION_TIMEOUT_SECONDS = setting("LLMGW_ACTIVATION_TIMEOUT_SECONDS")
# Router backstop: re-read the endpoint list this often even without a push.
LLMGW_ROUTER_POLL_SECONDS = setting("LLMGW_ROUTER_POLL_SECONDS")
LLMGW_USAGE_FLUSH_SECONDS = setting("LLMGW_USAGE_FLUSH_SECONDS")
# Router upstream deadlines: connecting to an engine, waiting for its first byte, silence between chunks.
LLMGW_UPSTREAM_CONNECT_SECONDS = setting("LLMGW_UPSTREAM_CONNECT_SECONDS")
LLMGW_UPSTREAM_FIRST_BYTE_SECONDS = setting("LLMGW_UPSTREAM_FIRST_BYTE_SECONDS")
LLMGW_UPSTREAM_IDLE_SECONDS = setting("LLMGW_UPSTREAM_IDLE_SECONDS")
# Requests one router holds per model while it starts; beyond, 503 with Retry-After.
LLMGW_MAX_WAITERS_PER_MODEL = setting("LLMGW_MAX_WAITERS_PER_MODEL")
LLMGW_STREAM_MIGRATIONS = setting("LLMGW_STREAM_MIGRATIONS")
LLMGW_QUEUE_MAX_WAITING = setting("LLMGW_QUEUE_MAX_WAITING")
LLMGW_QUEUE_MAX_WAIT_SECONDS = setting("LLMGW_QUEUE_MAX_WAIT_SECONDS")
LLMGW_BUDGET_RESERVATION_SECONDS = setting("LLMGW_BUDGET_RESERVATION_SECONDS")
LLMGW_BUDGET_OUTPUT_TOKENS = setting("LLMGW_BUDGET_OUTPUT_TOKENS")
LLMGW_REQUEST_RECORD_DAYS = setting("LLMGW_REQUEST_RECORD_DAYS")
# On SIGTERM the router lets in-flight requests finish this long before it exits.
LLMGW_SHUTDOWN_GRACE_SECONDS = setting("LLMGW_SHUTDOWN_GRACE_SECONDS")

# More than this share of the watched nodes silent at once (and more than one node): declare none lost.
LLMGW_PARTITION_BRAKE_FRACTION = setting("LLMGW_PARTITION_BRAKE_FRACTION")

# More models than cards (demand, eviction, safe stops).
# A profile with an empty idle timeout stops replicas above min after this long unused (known idle).
LLMGW_DEFAULT_IDLE_TIMEOUT_SECONDS = setting("LLMGW_DEFAULT_IDLE_TIMEOUT_SECONDS")
# Eviction takes only replicas idle at least this long and ready at least LLMGW_MIN_RESIDENCY_SECONDS.
LLMGW_EVICT_MIN_IDLE_SECONDS = setting("LLMGW_EVICT_MIN_IDLE_SECONDS")
LLMGW_MIN_RESIDENCY_SECONDS = setting("LLMGW_MIN_RESIDENCY_SECONDS")
LLMGW_HOST_MEMORY_SLEEP_FRACTION = setting("LLMGW_HOST_MEMORY_SLEEP_FRACTION")
LLMGW_MAX_SWAP_WAIT_SECONDS = setting("LLMGW_MAX_SWAP_WAIT_SECONDS")
# Load over the target concurrency must last this long before the tick adds a replica.
LLMGW_SCALE_OUT_AFTER_SECONDS = setting("LLMGW_SCALE_OUT_AFTER_SECONDS")
LLMGW_LATENCY_WINDOW_SECONDS = setting("LLMGW_LATENCY_WINDOW_SECONDS")
LLMGW_OBJECTIVE_SCALE_UP = setting("LLMGW_OBJECTIVE_SCALE_UP")
LLMGW_OBJECTIVE_SCALE_DOWN = setting("LLMGW_OBJECTIVE_SCALE_DOWN")
# A replica created for waiting requests is withdrawn if still unplaced this long after the last ask.
LLMGW_ACTIVATION_LINGER_SECONDS = setting("LLMGW_ACTIVATION_LINGER_SECONDS")
# Routers get the table without a replica leaving service this long before its engine drains or sleeps.
LLMGW_UNPUBLISH_GRACE_SECONDS = setting("LLMGW_UNPUBLISH_GRACE_SECONDS")
# A LoRA adapter load or unload an agent has not answered this long is forgotten (reconciler.adapters).
LLMGW_ADAPTER_LOAD_TIMEOUT_SECONDS = setting("LLMGW_ADAPTER_LOAD_TIMEOUT_SECONDS")
# How long an agent lets a draining engine finish its running requests before stopping it anyway.
LLMGW_DRAIN_TIMEOUT_SECONDS = setting("LLMGW_DRAIN_TIMEOUT_SECONDS")
# A router whose watch mark has lapsed this long is presumed gone (until then, idleness is unknown).
LLMGW_ROUTER_FORGET_SECONDS = setting("LLMGW_ROUTER_FORGET_SECONDS")

# The router balances on the engines' own load: each router reads each replica's /metrics this often, and skips replicas with less KV cache free.
LLMGW_ENGINE_POLL_SECONDS = setting("LLMGW_ENGINE_POLL_SECONDS")
LLMGW_KV_CACHE_FULL_FRACTION = setting("LLMGW_KV_CACHE_FULL_FRACTION")
# Requests sharing a prompt prefix go to the same replica while it has at most this many more in flight.
LLMGW_PREFIX_AFFINITY_SLACK = setting("LLMGW_PREFIX_AFFINITY_SLACK")

if not LLMGW_LLAMA_SERVER.strip():
    raise ImproperlyConfigured("LLMGW_LLAMA_SERVER must name the llama.cpp server binary, not be empty")
try:
    shlex.split(LLMGW_VLLM_COMMAND)
except ValueError as exc:
    raise ImproperlyConfigured(
        f"LLMGW_VLLM_COMMAND={LLMGW_VLLM_COMMAND!r} cannot be split into arguments: {exc}"
    ) from None
if LLMGW_OBJECTIVE_SCALE_DOWN >= LLMGW_OBJECTIVE_SCALE_UP:
    raise ImproperlyConfigured("LLMGW_OBJECTIVE_SCALE_DOWN must be below LLMGW_OBJECTIVE_SCALE_UP")
if LLMGW_LOST_AFTER_SECONDS < LLMGW_UNREACHABLE_AFTER_SECONDS:
    raise ImproperlyConfigured("LLMGW_LOST_AFTER_SECONDS must not be below LLMGW_UNREACHABLE_AFTER_SECONDS")
# Traces follow the standard OTEL_* variables (telemetry/); one llmgw cannot honour stops start-up here.
try:
    exporter_name()
except TracingConfigError as exc:
    raise ImproperlyConfigured(str(exc)) from None

# --- Celery (distributed mode) ------------------------------------------------
# Ticks go to the leader queue, which only the lease holder consumes (reconciler.leadership.campaign).
LLMGW_LEADER_QUEUE = "reconcile-leader"
CELERY_BROKER_URL = REDIS_URL or "memory://"
CELERY_TASK_IGNORE_RESULT = True
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_ROUTES = {"reconciler.tasks.tick": {"queue": LLMGW_LEADER_QUEUE}}
# Ticks run one at a time in the worker's main process, beside its lease campaign thread.
CELERY_WORKER_POOL = "solo"
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BEAT_SCHEDULE = {
    "reconcile-tick": {
        "task": "reconciler.tasks.tick",
        "schedule": LLMGW_TICK_SECONDS,
        # A tick that could not start within its interval is superseded by the next.
        "options": {"expires": LLMGW_TICK_SECONDS, "queue": LLMGW_LEADER_QUEUE},
    },
}
# Beat may run on every control-plane host: RedBeat keeps the schedule in Redis, and only
# the beat holding its Redis lock sends; another takes the lock once it lapses.
CELERY_BEAT_SCHEDULER = "llmgw_site.beat:RecoveringRedBeatScheduler"
CELERY_REDBEAT_REDIS_URL = CELERY_BROKER_URL
CELERY_REDBEAT_KEY_PREFIX = "llmgw:redbeat"
# A standby beat tries for the lock every tick interval (beat's loop is never longer).
CELERY_BEAT_MAX_LOOP_INTERVAL = LLMGW_TICK_SECONDS
# The holder extends its lock every loop; a dead holder's lock lapses after this.
CELERY_REDBEAT_LOCK_TIMEOUT = math.ceil(max(LLMGW_LEASE_TTL_SECONDS, 5 * LLMGW_TICK_SECONDS))

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": setting("LOG_LEVEL")},
    # httpx logs every request at INFO: the agent's health polls would drown the log.
    "loggers": {"django.channels.server": {"level": "WARNING"}, "httpx": {"level": "WARNING"}},
}
