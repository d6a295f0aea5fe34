"""Django settings for llmgw, all taken from the environment (see README).

Unset DATABASE_URL means SQLite in var/; unset REDIS_URL means embedded mode,
with in-process channel layer, endpoint list, usage store and activation queue.
"""

import math
import secrets
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from .env import env_bool, env_float, env_int, env_port, env_port_range, env_str

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(env_str("LLMGW_VAR_DIR", str(BASE_DIR / "var")))

DEBUG = env_bool("DEBUG", False)
DATABASE_URL = env_str("DATABASE_URL")
REDIS_URL = env_str("REDIS_URL") or None
EMBEDDED = REDIS_URL is None


def _secret_key() -> str:
    key = env_str("SECRET_KEY")
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
LLMGW_HOST = env_str("LLMGW_HOST", "127.0.0.1")
ALLOWED_HOSTS = [
    h.strip() for h in env_str("ALLOWED_HOSTS", f"127.0.0.1,localhost,[::1],{LLMGW_HOST}").split(",") if h.strip()
]
CSRF_TRUSTED_ORIGINS = [o.strip() for o in env_str("CSRF_TRUSTED_ORIGINS", "").split(",") if o.strip()]

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
    "django_prometheus",
    "catalog",
    "inventory",
    "reconciler",
    "router",
    "dashboard",
    "agent",
    "agentlink",
    "runner",
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
    DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": VAR_DIR / "llmgw.sqlite3"}}

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
STATIC_ROOT = env_str("STATIC_ROOT")
WHITENOISE_USE_FINDERS = True
WHITENOISE_AUTOREFRESH = DEBUG


def channel_layers(redis_url: str | None) -> dict:
    """The channel layer: in-process when embedded, Redis otherwise."""
    if redis_url is None:
        return {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    # channels-redis blocks 5 s in BZPOPMIN per receive; redis-py's default socket
    # timeout is also 5 s, which would kill every idle consumer. Give reads headroom.
    host = {"address": redis_url, "socket_timeout": 30, "socket_connect_timeout": 5}
    return {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [host], "prefix": "llmgw:asgi"},
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
}

# --- llmgw -------------------------------------------------------------------
LLMGW_PORT = env_port("LLMGW_PORT", 8000)
LLMGW_ROUTER_PORT = env_port("LLMGW_ROUTER_PORT", 8080)
# Seconds between reconcile ticks (Celery beat in distributed mode).
LLMGW_TICK_SECONDS = env_float("LLMGW_TICK_SECONDS", 2.0, minimum=0.1)
LLMGW_LEASE_NAME = "reconciler"
LLMGW_LEASE_TTL_SECONDS = env_float("LLMGW_LEASE_TTL_SECONDS", 15.0, minimum=1.0)
LLMGW_HEARTBEAT_SECONDS = env_float("LLMGW_HEARTBEAT_SECONDS", 5.0, minimum=0.1)
LLMGW_UNREACHABLE_AFTER_SECONDS = env_float("LLMGW_UNREACHABLE_AFTER_SECONDS", 20.0, minimum=1.0)
LLMGW_LOST_AFTER_SECONDS = env_float("LLMGW_LOST_AFTER_SECONDS", 120.0, minimum=1.0)
# An unhealthy GPU must report healthy this long before it is used again.
LLMGW_GPU_QUARANTINE_SECONDS = env_float("LLMGW_GPU_QUARANTINE_SECONDS", 300.0, minimum=0.0)
# A shard still "assigned" (start sent, no answer) this long gets its start command again.
LLMGW_START_RESEND_SECONDS = env_float("LLMGW_START_RESEND_SECONDS", 10.0, minimum=0.5)
LLMGW_SHARD_START_TIMEOUT_SECONDS = env_float("LLMGW_SHARD_START_TIMEOUT_SECONDS", 900.0, minimum=1.0)
LLMGW_BACKOFF_BASE_SECONDS = env_float("LLMGW_BACKOFF_BASE_SECONDS", 5.0, minimum=0.0)
LLMGW_BACKOFF_MAX_SECONDS = env_float("LLMGW_BACKOFF_MAX_SECONDS", 300.0, minimum=0.0)
# A replica ready this long has its failure count reset: the next failure backs off from the base again.
LLMGW_BACKOFF_RESET_SECONDS = env_float("LLMGW_BACKOFF_RESET_SECONDS", 120.0, minimum=0.0)
LLMGW_ENGINE_PORT_RANGE = env_port_range("LLMGW_ENGINE_PORT_RANGE", (20000, 29999))
# A port an agent found taken by another program is not given to that host again for this long.
LLMGW_BUSY_PORT_SECONDS = env_float("LLMGW_BUSY_PORT_SECONDS", 600.0, minimum=0.0)
# How long the router holds a request for a model that is starting.
LLMGW_ACTIVATION_TIMEOUT_SECONDS = env_float("LLMGW_ACTIVATION_TIMEOUT_SECONDS", 120.0, minimum=0.0)
# Router backstop: re-read the endpoint list this often even without a push.
LLMGW_ROUTER_POLL_SECONDS = env_float("LLMGW_ROUTER_POLL_SECONDS", 5.0, minimum=0.1)
LLMGW_USAGE_FLUSH_SECONDS = env_float("LLMGW_USAGE_FLUSH_SECONDS", 1.0, minimum=0.05)
# Router upstream deadlines: connecting to an engine, waiting for its first byte, silence between chunks.
LLMGW_UPSTREAM_CONNECT_SECONDS = env_float("LLMGW_UPSTREAM_CONNECT_SECONDS", 5.0, minimum=0.001)
LLMGW_UPSTREAM_FIRST_BYTE_SECONDS = env_float("LLMGW_UPSTREAM_FIRST_BYTE_SECONDS", 600.0, minimum=0.001)
LLMGW_UPSTREAM_IDLE_SECONDS = env_float("LLMGW_UPSTREAM_IDLE_SECONDS", 120.0, minimum=0.001)
# Requests one router holds per model while it starts; beyond, 503 with Retry-After.
LLMGW_MAX_WAITERS_PER_MODEL = env_int("LLMGW_MAX_WAITERS_PER_MODEL", 1000, minimum=1)
# On SIGTERM the router lets in-flight requests finish this long before it exits.
LLMGW_SHUTDOWN_GRACE_SECONDS = env_float("LLMGW_SHUTDOWN_GRACE_SECONDS", 30.0, minimum=0.0)

# More than this share of the watched nodes silent at once (and more than one node): declare none lost.
LLMGW_PARTITION_BRAKE_FRACTION = env_float("LLMGW_PARTITION_BRAKE_FRACTION", 0.3, minimum=0.0)

# More models than cards (demand, eviction, safe stops).
# A profile with an empty idle timeout stops replicas above min after this long unused (known idle).
LLMGW_DEFAULT_IDLE_TIMEOUT_SECONDS = env_float("LLMGW_DEFAULT_IDLE_TIMEOUT_SECONDS", 1800.0, minimum=1.0)
# Eviction takes only replicas idle at least this long and ready at least LLMGW_MIN_RESIDENCY_SECONDS.
LLMGW_EVICT_MIN_IDLE_SECONDS = env_float("LLMGW_EVICT_MIN_IDLE_SECONDS", 60.0, minimum=0.0)
LLMGW_MIN_RESIDENCY_SECONDS = env_float("LLMGW_MIN_RESIDENCY_SECONDS", 300.0, minimum=0.0)
# Load over the target concurrency must last this long before the tick adds a replica.
LLMGW_SCALE_OUT_AFTER_SECONDS = env_float("LLMGW_SCALE_OUT_AFTER_SECONDS", 30.0, minimum=0.0)
# A replica created for waiting requests is withdrawn if still unplaced this long after the last ask.
LLMGW_ACTIVATION_LINGER_SECONDS = env_float("LLMGW_ACTIVATION_LINGER_SECONDS", 10.0, minimum=1.0)
# How long an agent lets a draining engine finish its running requests before stopping it anyway.
LLMGW_DRAIN_TIMEOUT_SECONDS = env_float("LLMGW_DRAIN_TIMEOUT_SECONDS", 300.0, minimum=0.0)
# A router whose watch mark has lapsed this long is presumed gone (until then, idleness is unknown).
LLMGW_ROUTER_FORGET_SECONDS = env_float("LLMGW_ROUTER_FORGET_SECONDS", 300.0, minimum=1.0)

# The router balances on the engines' own load: each router reads each replica's /metrics this often, and skips replicas with less KV cache free.
LLMGW_ENGINE_POLL_SECONDS = env_float("LLMGW_ENGINE_POLL_SECONDS", 1.0, minimum=0.1)
LLMGW_KV_CACHE_FULL_FRACTION = env_float("LLMGW_KV_CACHE_FULL_FRACTION", 0.95, minimum=0.0)
# Requests sharing a prompt prefix go to the same replica while it has at most this many more in flight.
LLMGW_PREFIX_AFFINITY_SLACK = env_int("LLMGW_PREFIX_AFFINITY_SLACK", 4, minimum=0)

if LLMGW_LOST_AFTER_SECONDS < LLMGW_UNREACHABLE_AFTER_SECONDS:
    raise ImproperlyConfigured("LLMGW_LOST_AFTER_SECONDS must not be below LLMGW_UNREACHABLE_AFTER_SECONDS")

# --- Celery (distributed mode) ------------------------------------------------
# Ticks go to the leader queue, which only the lease holder consumes (reconciler.campaign).
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
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
    # httpx logs every request at INFO: the agent's health polls would drown the log.
    "loggers": {"django.channels.server": {"level": "WARNING"}, "httpx": {"level": "WARNING"}},
}
