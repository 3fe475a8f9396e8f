"""Settings for the V100 inference portal, read from the environment.

One module for every environment. Each variable is parsed strictly (django-environ, and
portal/envparse.py for booleans, bounded numbers, retention days and networks): a typo in a
boolean, a malformed URL or an out-of-range number stops the process at start instead of running
with a silent default. docs/configuration.md lists every variable
(tests/core/test_configuration_doc.py checks).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from celery.schedules import crontab
from django.core.exceptions import ImproperlyConfigured

from portal.core.redis.keys import NAMESPACE_RE, RedisKeys, namespace_for_database
from portal.envparse import env, env_bool, env_networks, env_number, env_positive_int, env_retention_days

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = BASE_DIR / "var"

DEBUG = env_bool("DEBUG", default=False)

_DEV_SECRET_KEY = "insecure-development-key-only-for-debug-mode"  # noqa: S105
SECRET_KEY = env.str("SECRET_KEY", default=_DEV_SECRET_KEY if DEBUG else "")
if not SECRET_KEY:
    raise ImproperlyConfigured("SECRET_KEY must be set when DEBUG is off")

ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["127.0.0.1", "localhost"])
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])
# A form whose session is gone gets a page that says so, not Django's bare 403.
CSRF_FAILURE_VIEW = "portal.core.views.csrf_failure"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "servestatic.runserver_nostatic",
    "django.contrib.staticfiles",
    "django.contrib.humanize",  # intcomma: thousands separators on the usage pages
    "rest_framework",
    "django_filters",  # list filters: one FilterSet per model, in each app's filters.py
    "drf_spectacular",
    "axes",
    "portal.core",
    "portal.teams",
    "portal.inventory",
    "portal.registry",
    "portal.deployments",
    "portal.gateway",
    "portal.playground",
    "portal.batches",
    "portal.benchmarks",
    "portal.observability",
    "portal.rollouts",
    "portal.audit",
    "portal.dashboard",  # the top: reads and writes across the others (docs/architecture.md#layers)
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "servestatic.middleware.ServeStaticMiddleware",
    "portal.core.middleware.RejectUnstorableTextMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "portal.audit.middleware.AuditContextMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Last: turns a locked-out login (form or admin) into a 429 page.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "portal.urls"
ASGI_APPLICATION = "portal.asgi.application"
WSGI_APPLICATION = "portal.wsgi.application"

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

# SQLite under var/ is the embedded default for a laptop; production and CI
# point DATABASE_URL at PostgreSQL.
if "DATABASE_URL" not in env:
    VAR_DIR.mkdir(exist_ok=True)
DATABASES = {"default": env.db("DATABASE_URL", default=f"sqlite:///{VAR_DIR / 'portal.sqlite3'}")}
DATABASES["default"]["CONN_MAX_AGE"] = env_number(
    "DATABASE_CONN_MAX_AGE", default=60, minimum=0, maximum=86_400
)
# A connection that died while idle (PostgreSQL restarted) is replaced, not reused.
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # SQLite (a laptop, one GPU node) is written by the web process, the workers, the agent and beat
    # at once: WAL lets readers go on beside a writer, IMMEDIATE takes the write lock when a
    # transaction starts (not halfway, where SQLite cannot wait for it), and a writer waits up to
    # 20 s for another instead of failing at once with "database is locked".
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        timeout=20, transaction_mode="IMMEDIATE", init_command="PRAGMA journal_mode=WAL"
    )

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

# Uploaded and generated files (batch inputs and outputs) through default_storage; any
# django-storages backend can replace the local file system in STORAGES["default"].
MEDIA_ROOT = env.path("MEDIA_ROOT", default=str(VAR_DIR / "media"))

STATIC_URL = "static/"
STATIC_ROOT = env.path("STATIC_ROOT", default=str(VAR_DIR / "static"))
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        "BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"
        if DEBUG
        else "servestatic.storage.CompressedManifestStaticFilesStorage"
    },
}

# With DEBUG on, servestatic serves static files straight from the apps (no collectstatic).
SERVESTATIC_USE_FINDERS = DEBUG

# --- Pages served by an app above the model's own -------------------------------------------------
# A node's page is benchmarks' (it shows acceptance), a team's overview is deployments' (GPUs held),
# a deployment's page is observability's (production latency): docs/architecture.md#layers. The
# model's own app sits below and names no app above it, so the project, above every app, gives those
# models their get_absolute_url here (Django's ABSOLUTE_URL_OVERRIDES).


def _page(url_name: str, field: str) -> Callable[[object], str]:
    def get_absolute_url(instance: object) -> str:
        from django.urls import reverse

        return reverse(url_name, args=[getattr(instance, field)])

    return get_absolute_url


ABSOLUTE_URL_OVERRIDES = {
    "inventory.node": _page("nodes:detail", "name"),
    "teams.team": _page("deployments:team-detail", "slug"),
    "deployments.deployment": _page("observability:deployment-detail", "name"),
}

LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "dashboard:home"
LOGOUT_REDIRECT_URL = "login"

# --- Password guessing: django-axes counts failed logins (form, admin, the API's Basic auth) ---
# Its backend comes first and refuses a locked-out username or address before a password hash is run.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]


# The client's address, one rule everywhere (portal/core/clientaddr.py): the TCP peer, or behind
# this many reverse proxies, the address the outermost one appended to X-Forwarded-For.
TRUSTED_PROXY_COUNT = int(env_number("TRUSTED_PROXY_COUNT", default=0, minimum=0, maximum=5))
AXES_CLIENT_IP_CALLABLE = "portal.core.clientaddr.client_address"

# Failures are counted per address: LOGIN_FAILURE_LIMIT wrong passwords from one address, for one
# username or for many, lock that address (so that username from that address too) out; the right
# password from an address that has not failed still works, so a stranger cannot keep an admin out.
AXES_FAILURE_LIMIT = env_positive_int("LOGIN_FAILURE_LIMIT", default=5, maximum=1000)
AXES_LOCKOUT_PARAMETERS = ["ip_address"]
# A lockout ends this long after the last counted failure; guesses made while locked out are
# refused without being counted, so they do not push the end further away.
AXES_COOLOFF_TIME = timedelta(
    minutes=env_positive_int("LOGIN_LOCKOUT_MINUTES", default=15, maximum=7 * 24 * 60)
)
AXES_RESET_COOL_OFF_ON_FAILURE_DURING_LOCKOUT = False
# Successful logins are not recorded by axes: that table would only grow.
AXES_DISABLE_ACCESS_LOG = True

# --- Security: strict by default, relaxed only for local DEBUG runs ---------
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", default=not DEBUG)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", default=not DEBUG)
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", default=not DEBUG)
SECURE_HSTS_SECONDS = env_number(
    "SECURE_HSTS_SECONDS", default=0 if DEBUG else 31536000, minimum=0, maximum=2 * 31536000
)
SECURE_HSTS_INCLUDE_SUBDOMAINS = not DEBUG
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", default=not DEBUG)
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
X_FRAME_OPTIONS = "DENY"
# Behind a TLS-terminating proxy the scheme arrives in this header.
if env_bool("SECURE_PROXY_SSL", default=False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SILENCED_SYSTEM_CHECKS = env.list("SILENCED_SYSTEM_CHECKS", default=[])

# The largest request body the pages and the REST API read (nothing here uploads files);
# portal/asgi.py refuses a longer one with a 413 before reading it whole (Django's default).
DATA_UPLOAD_MAX_MEMORY_SIZE = env_number(
    "DATA_UPLOAD_MAX_MEMORY_SIZE", default=2_621_440, minimum=1024, maximum=1 << 30
)

# --- REST API ----------------------------------------------------------------
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.SessionAuthentication",
        "portal.core.authentication.BasicAuthentication",  # counts failed guesses (axes)
    ],
    "DEFAULT_PERMISSION_CLASSES": ["portal.core.permissions.StaffWritesAuthenticatedReads"],
    # DRF's own, but a body nested too deeply to parse is a 400 (portal/core/api.py).
    "DEFAULT_PARSER_CLASSES": [
        "portal.core.api.JSONParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "portal.core.api.exception_handler",
    # `?state=serving&node=…` on every list: the FilterSet of the viewset's `filterset_class`.
    "DEFAULT_FILTER_BACKENDS": ["django_filters.rest_framework.DjangoFilterBackend"],
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.LimitOffsetPagination",
    "PAGE_SIZE": 100,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "V100 inference portal API",
    "DESCRIPTION": "Inventory, model registry, deployment profiles, deployments and the capacity planner.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    # The schema answers whom the API answers (session or Basic auth, throttled by axes), no one else.
    "SERVE_PERMISSIONS": ["rest_framework.permissions.IsAuthenticated"],
}

# --- Redis namespace ------------------------------------------------------------
# Every Redis key of this installation (quotas, usage records, metrics, Celery queues) starts
# with it (portal/core/redis/keys.py), so installations sharing a Redis server never mix data.
# Unset: derived from the database's identity (engine, host, port, name).
# Derived, a namespace depends on every process spelling the database alike (normalised, but a
# host alias still differs): `check --deploy` refuses a derived one, and each process reports the
# namespace it uses (portal/core/heartbeat.py) so the dashboard shows a split.
PORTAL_REDIS_NAMESPACE_DERIVED = not env.str("PORTAL_REDIS_NAMESPACE", default="").strip()
PORTAL_REDIS_NAMESPACE = env.str("PORTAL_REDIS_NAMESPACE", default="").strip() or namespace_for_database(
    DATABASES["default"]
)
if not NAMESPACE_RE.fullmatch(PORTAL_REDIS_NAMESPACE):
    raise ImproperlyConfigured(
        f"PORTAL_REDIS_NAMESPACE={PORTAL_REDIS_NAMESPACE!r}: use 1-64 letters, digits, '_', '.' or '-'"
    )

# --- Celery --------------------------------------------------------------------
REDIS_URL = env.str("REDIS_URL", default="redis://127.0.0.1:6379/0")
CELERY_BROKER_URL = env.str("CELERY_BROKER_URL", default=REDIS_URL)
CELERY_RESULT_BACKEND = env.str("CELERY_RESULT_BACKEND", default=REDIS_URL)
CELERY_TASK_DEFAULT_QUEUE = "control"
CELERY_TASK_ALWAYS_EAGER = env_bool("CELERY_TASK_ALWAYS_EAGER", default=False)
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_ACKS_LATE = False  # opted into per task, where a task is safe to repeat
# Longer than the longest task (a model start can take many minutes), so Redis
# does not redeliver a message whose task is still running.
CELERY_BROKER_TRANSPORT_OPTIONS: dict[str, Any] = {
    "visibility_timeout": env_number(
        "CELERY_VISIBILITY_TIMEOUT", default=7200, minimum=60, maximum=7 * 86_400
    ),
    # Queues keep their names (`control`, `node.<name>`); their Redis keys are namespaced.
    "global_keyprefix": RedisKeys(PORTAL_REDIS_NAMESPACE).celery,
}
CELERY_RESULT_BACKEND_TRANSPORT_OPTIONS = {"global_keyprefix": RedisKeys(PORTAL_REDIS_NAMESPACE).celery}
# A task that dies with its worker process goes back to the queue (only acks_late
# tasks, which are the ones safe to run again: the deployment lease makes a
# repeat a no-op or a resume).
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_EXPIRES = 3600
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Benchmarks have their own worker (`celery -A portal worker -Q benchmarks`); see portal/celery.py.
# Batch runners and validation too (`-Q batches`): a batch runs for hours.
CELERY_TASK_ROUTES = {
    "benchmarks.run": {"queue": "benchmarks"},
    "batches.run": {"queue": "batches"},
    "batches.validate": {"queue": "batches"},
}

# --- The portal itself ------------------------------------------------------------
# Name of the node this process runs on when it acts as a node agent.
PORTAL_LOCAL_NODE = env.str("PORTAL_LOCAL_NODE", default="local")
# bf16 → fp16 conversion jobs renew a lease with each progress write (several a
# second); a running job whose lease lapsed is shown as interrupted and may be
# superseded by a new job for the same output.
PORTAL_CONVERSION_LEASE_S = env_number("PORTAL_CONVERSION_LEASE_S", default=120, minimum=1, maximum=3600)

# --- Deployments: what node agents do with server processes (docs/concurrency.md) ---
# Where an agent keeps each deployment's log and generated files.
PORTAL_RUN_DIR = env.str("PORTAL_RUN_DIR", default=str(VAR_DIR / "run"))
DEPLOYMENT_LEASE_TTL_S = env_number("DEPLOYMENT_LEASE_TTL_S", default=90, minimum=1, maximum=3600)
# vLLM must list its model within this time after launch (a 70B load from disk takes minutes).
DEPLOYMENT_READY_TIMEOUT_S = env_number("DEPLOYMENT_READY_TIMEOUT_S", default=1200, minimum=5, maximum=86_400)
DEPLOYMENT_DRAIN_TIMEOUT_S = env_number("DEPLOYMENT_DRAIN_TIMEOUT_S", default=60, minimum=0, maximum=3600)
DEPLOYMENT_STOP_GRACE_S = env_number("DEPLOYMENT_STOP_GRACE_S", default=30, minimum=1, maximum=600)
DEPLOYMENT_SUPERVISE_INTERVAL_S = env_number(
    "DEPLOYMENT_SUPERVISE_INTERVAL_S", default=15, minimum=1, maximum=3600
)
DEPLOYMENT_HEALTH_FAILURES = env_number("DEPLOYMENT_HEALTH_FAILURES", default=3, minimum=1, maximum=100)
DEPLOYMENT_RESTART_LIMIT = env_number("DEPLOYMENT_RESTART_LIMIT", default=5, minimum=0, maximum=1000)
DEPLOYMENT_RESTART_BACKOFF_S = env_number(
    "DEPLOYMENT_RESTART_BACKOFF_S", default=10.0, minimum=0.0, maximum=3600.0
)
# The engine's server.log: copy-truncated past this size by supervision, this many old copies kept.
ENGINE_LOG_MAX_BYTES = env_number(
    "ENGINE_LOG_MAX_BYTES", default=64 * 1024 * 1024, minimum=64 * 1024, maximum=2**40
)
ENGINE_LOG_KEEP = env_number("ENGINE_LOG_KEEP", default=3, minimum=0, maximum=100)
# A node agent keeps its servers running when it exits (a restarted agent adopts them again);
# `make run` sets this on its agent so Ctrl-C leaves no vLLM behind on a laptop.
PORTAL_AGENT_STOP_SERVERS_ON_EXIT = env_bool("PORTAL_AGENT_STOP_SERVERS_ON_EXIT", default=False)
if CELERY_BROKER_TRANSPORT_OPTIONS["visibility_timeout"] <= DEPLOYMENT_READY_TIMEOUT_S + 600:
    raise ImproperlyConfigured("CELERY_VISIBILITY_TIMEOUT must exceed DEPLOYMENT_READY_TIMEOUT_S + 600")


# --- Node agents' heartbeat (portal/inventory/tasks.py) -------------------------------
# Beat sends each node's agent a heartbeat this often; the agent records when it answered and what it runs.
NODE_HEARTBEAT_INTERVAL_S = env_number("NODE_HEARTBEAT_INTERVAL_S", default=15, minimum=1, maximum=3600)
# A node whose agent has not answered for this long is shown as "not heard from" (default: 3 heartbeats).
NODE_AGENT_SILENT_S = env_number("NODE_AGENT_SILENT_S", default=3 * NODE_HEARTBEAT_INTERVAL_S, minimum=1)
if not NODE_HEARTBEAT_INTERVAL_S <= NODE_AGENT_SILENT_S <= 86400:
    raise ImproperlyConfigured(
        f"NODE_AGENT_SILENT_S={NODE_AGENT_SILENT_S} must be between NODE_HEARTBEAT_INTERVAL_S "
        f"({NODE_HEARTBEAT_INTERVAL_S}) and 86400"
    )
# A deployment still `pending` this long after its last step says on its timeline that no agent
# picked it up, and whether its node's agent is listening.
DEPLOYMENT_PENDING_WARN_S = env_number("DEPLOYMENT_PENDING_WARN_S", default=60, minimum=5, maximum=86400)

# --- Benchmarks (portal/benchmarks): what a non-staff user may ask of one run -------------
BENCHMARK_MEMBER_MAX_LEVELS = env_number("BENCHMARK_MEMBER_MAX_LEVELS", default=8, minimum=1, maximum=1000)
BENCHMARK_MEMBER_MAX_CONCURRENCY = env_number(
    "BENCHMARK_MEMBER_MAX_CONCURRENCY", default=64, minimum=1, maximum=100_000
)
BENCHMARK_MEMBER_MAX_REQUEST_RATE = env_number(
    "BENCHMARK_MEMBER_MAX_REQUEST_RATE", default=16.0, minimum=0.01, maximum=100_000.0
)
BENCHMARK_MEMBER_MAX_REQUESTS_PER_LEVEL = env_number(
    "BENCHMARK_MEMBER_MAX_REQUESTS_PER_LEVEL", default=1000, minimum=1, maximum=1_000_000
)
# Bounds a member's duration per level and level timeout; a member's level without a timeout gets this one.
BENCHMARK_MEMBER_MAX_LEVEL_S = env_number(
    "BENCHMARK_MEMBER_MAX_LEVEL_S", default=600.0, minimum=1.0, maximum=86_400.0
)


# Link-local and cloud-metadata addresses an adopted endpoint may use after all
# (portal/deployments/endpoints.py refuses them by default): CIDR networks, comma-separated.
ADOPTED_ENDPOINT_ALLOWED_NETWORKS = env_networks("ADOPTED_ENDPOINT_ALLOWED_NETWORKS")
# A running benchmark's lease (portal/benchmarks/services/execution.py): its job renews it every
# half second; a run whose lease lapses has lost its worker, and the beat sweep
# (benchmarks.expire_runs, every BENCHMARK_SWEEP_INTERVAL_S) ends it as failed (partial with levels).
BENCHMARK_LEASE_S = env_number("BENCHMARK_LEASE_S", default=120, minimum=2, maximum=3600)
BENCHMARK_SWEEP_INTERVAL_S = env_number("BENCHMARK_SWEEP_INTERVAL_S", default=30, minimum=1, maximum=3600)
# Where benchmark workers reach the gateway: a member's run is that team's traffic and goes
# through it (docs/decisions.md, "A member's benchmark is the team's traffic"). The web process.
# Unset, it is this portal itself: the port `make run` and the Procfile serve on (PORTAL_PORT), so
# a portal on 8100 does not send members' runs to whatever listens on 8000 (issue 38).
PORTAL_PORT = env_number("PORTAL_PORT", default=8000, minimum=1, maximum=65535)
_PORTAL_HOST = env.str("PORTAL_HOST", default="127.0.0.1").strip() or "127.0.0.1"
# A wildcard listen address is not one a client can dial; the loopback address reaches it.
_PORTAL_DIAL_HOST = "127.0.0.1" if _PORTAL_HOST in ("0.0.0.0", "::", "[::]") else _PORTAL_HOST  # noqa: S104
if ":" in _PORTAL_DIAL_HOST and not _PORTAL_DIAL_HOST.startswith("["):
    _PORTAL_DIAL_HOST = f"[{_PORTAL_DIAL_HOST}]"
BENCHMARK_GATEWAY_URL_DERIVED = not env.str("BENCHMARK_GATEWAY_URL", default="").strip()
BENCHMARK_GATEWAY_URL = (
    env.str("BENCHMARK_GATEWAY_URL", default="").strip().rstrip("/")
    or f"http://{_PORTAL_DIAL_HOST}:{PORTAL_PORT}"
)
if not re.fullmatch(r"https?://[^\s/?#]+(/[^\s?#]*)?", BENCHMARK_GATEWAY_URL):
    raise ImproperlyConfigured(
        f"BENCHMARK_GATEWAY_URL={BENCHMARK_GATEWAY_URL!r} must be an http(s) URL, e.g. http://127.0.0.1:8000"
    )
# --- The planner's "predict this profile" page: it simulates inside the web process ---------
PREDICT_MAX_LEVELS = env_number("PREDICT_MAX_LEVELS", default=8, minimum=1, maximum=1000)
PREDICT_MAX_CONCURRENCY = env_number("PREDICT_MAX_CONCURRENCY", default=1024, minimum=1, maximum=1_000_000)
# Sync views share one thread per ASGI web process: a prediction holds every page of it that long.
PREDICT_TIME_BUDGET_S = env_number("PREDICT_TIME_BUDGET_S", default=10.0, minimum=0.01, maximum=600.0)

# --- Node acceptance (portal/benchmarks/acceptance/) ---------------------------------
# Measured output tok/s below, or mean TPOT above, the simulator's prediction by more than this
# fraction at any level marks an acceptance `slow` (docs/decisions.md).
ACCEPTANCE_SLOW_MARGIN = env_number("ACCEPTANCE_SLOW_MARGIN", default=0.25, minimum=0.0, maximum=1.0)
if not 0 < ACCEPTANCE_SLOW_MARGIN < 1:
    raise ImproperlyConfigured(f"ACCEPTANCE_SLOW_MARGIN={ACCEPTANCE_SLOW_MARGIN} must be between 0 and 1")
# Where a node writes its reference models (a 7B shape is 13 GB; same seed, same bytes on every node).
ACCEPTANCE_MODEL_DIR = env.str("ACCEPTANCE_MODEL_DIR", default=str(VAR_DIR / "acceptance"))
# A running acceptance without a progress write for this long is taken as abandoned (its agent died).
ACCEPTANCE_STALE_S = env_number("ACCEPTANCE_STALE_S", default=3600, minimum=60, maximum=7 * 86_400)


# --- GPU health (inference/gpu_health/): each node agent's telemetry sample and its rules -----
# How often beat asks every node with GPUs for a sample (one row per GPU per minute is kept).
GPU_HEALTH_SAMPLE_INTERVAL_S = env_number(
    "GPU_HEALTH_SAMPLE_INTERVAL_S", default=60.0, minimum=5.0, maximum=3600.0
)
# The longest one nvidia-smi (or dmesg) call may take: a hung driver is then a GPU that did not answer.
GPU_HEALTH_COMMAND_TIMEOUT_S = env_number(
    "GPU_HEALTH_COMMAND_TIMEOUT_S", default=10.0, minimum=1.0, maximum=120.0
)
if 2 * GPU_HEALTH_COMMAND_TIMEOUT_S >= GPU_HEALTH_SAMPLE_INTERVAL_S:  # two calls per sample
    raise ImproperlyConfigured(
        f"GPU_HEALTH_COMMAND_TIMEOUT_S={GPU_HEALTH_COMMAND_TIMEOUT_S} must be below half of "
        f"GPU_HEALTH_SAMPLE_INTERVAL_S={GPU_HEALTH_SAMPLE_INTERVAL_S}"
    )
# Thermal or power throttling this many minutes in a row: a warning.
GPU_HEALTH_THROTTLE_MINUTES = env_number(
    "GPU_HEALTH_THROTTLE_MINUTES", default=5.0, minimum=1.0, maximum=1440.0
)
# A GPU core at or above this temperature: a warning (V100s slow down from about 87 °C).
GPU_HEALTH_TEMPERATURE_WARNING_C = env_number(
    "GPU_HEALTH_TEMPERATURE_WARNING_C", default=85.0, minimum=40.0, maximum=120.0
)
# Xid events older than this are history, not a reading (the kernel log keeps them until reboot).
GPU_HEALTH_XID_WINDOW_MINUTES = env_number(
    "GPU_HEALTH_XID_WINDOW_MINUTES", default=60.0, minimum=1.0, maximum=10080.0
)

# --- Gateway (portal/gateway): the OpenAI-compatible proxy -------------------------
# Key digests are HMAC-SHA256 under this secret; by default derived from SECRET_KEY
# (so rotating SECRET_KEY invalidates every API key unless this is set on its own).
GATEWAY_KEY_HMAC_SECRET = env.str("GATEWAY_KEY_HMAC_SECRET", default="")
GATEWAY_REDIS_URL = env.str("GATEWAY_REDIS_URL", default=REDIS_URL)
# Redis behind Sentinel (docs/scale.md, "Redis: persistence and failover"): the service name and
# the Sentinels' `host:port` list. The portal's clients then ask the Sentinels for the primary
# (GATEWAY_REDIS_URL gives only the database, password and TLS), and Celery's broker and results
# default to the same Sentinels.
REDIS_SENTINEL_MASTER = env.str("REDIS_SENTINEL_MASTER", default="").strip()
REDIS_SENTINELS = [s.strip() for s in env.list("REDIS_SENTINELS", default=[]) if s.strip()]
if REDIS_SENTINEL_MASTER and not REDIS_SENTINELS:
    raise ImproperlyConfigured(
        "REDIS_SENTINELS must list the Sentinels (host:port,...) when REDIS_SENTINEL_MASTER is set"
    )
for _sentinel in REDIS_SENTINELS:
    _host, _, _port = _sentinel.rpartition(":")
    if not _host or not _port.isdigit() or not 0 < int(_port) < 65536:
        raise ImproperlyConfigured(f"REDIS_SENTINELS: {_sentinel!r} is not host:port")
if REDIS_SENTINEL_MASTER:
    # kombu's Sentinel transport: `sentinel://host:port;sentinel://host:port` plus the service name.
    _sentinel_url = ";".join(f"sentinel://{s}" for s in REDIS_SENTINELS)
    if "CELERY_BROKER_URL" not in env:
        CELERY_BROKER_URL = _sentinel_url
    if "CELERY_RESULT_BACKEND" not in env:
        CELERY_RESULT_BACKEND = _sentinel_url
    CELERY_BROKER_TRANSPORT_OPTIONS["master_name"] = REDIS_SENTINEL_MASTER
    CELERY_RESULT_BACKEND_TRANSPORT_OPTIONS["master_name"] = REDIS_SENTINEL_MASTER
GATEWAY_MAX_BODY_BYTES = env_number(
    "GATEWAY_MAX_BODY_BYTES", default=1024 * 1024, minimum=1024, maximum=64 * 1024 * 1024
)
GATEWAY_CACHE_S = env_number(
    "GATEWAY_CACHE_S", default=5.0, minimum=0.0, maximum=3600.0
)  # keys and routes, per process
# How long past GATEWAY_CACHE_S a cached key or route may still answer while one load refreshes it;
# older, requests wait for the reload. A change is seen within GATEWAY_CACHE_S + this (+ one load).
GATEWAY_CACHE_GRACE_S = env_number("GATEWAY_CACHE_GRACE_S", default=2.0, minimum=0.0, maximum=60.0)
GATEWAY_QUEUE_MAX = env_number(
    "GATEWAY_QUEUE_MAX", default=256, minimum=1, maximum=100_000
)  # waiting requests per model
GATEWAY_QUEUE_TIMEOUT_S = env_number("GATEWAY_QUEUE_TIMEOUT_S", default=10.0, minimum=0.01, maximum=3600.0)
GATEWAY_LONG_PROMPT_TOKENS = env_number(
    "GATEWAY_LONG_PROMPT_TOKENS", default=2000, minimum=1, maximum=10_000_000
)
GATEWAY_LONG_PROMPT_MAX_INFLIGHT = env_number(
    "GATEWAY_LONG_PROMPT_MAX_INFLIGHT", default=2, minimum=1, maximum=100_000
)
GATEWAY_FIRST_TOKEN_TIMEOUT_S = env_number(
    "GATEWAY_FIRST_TOKEN_TIMEOUT_S", default=30.0, minimum=0.1, maximum=3600.0
)
GATEWAY_FIRST_TOKEN_TIMEOUT_LONG_S = env_number(
    "GATEWAY_FIRST_TOKEN_TIMEOUT_LONG_S", default=60.0, minimum=0.1, maximum=3600.0
)
GATEWAY_READ_TIMEOUT_S = env_number("GATEWAY_READ_TIMEOUT_S", default=60.0, minimum=0.1, maximum=3600.0)
GATEWAY_CONNECT_TIMEOUT_S = env_number("GATEWAY_CONNECT_TIMEOUT_S", default=5.0, minimum=0.01, maximum=300.0)
GATEWAY_MAX_CONNECTIONS = env_number("GATEWAY_MAX_CONNECTIONS", default=1000, minimum=1, maximum=100_000)
# What an upstream may send (docs/decisions.md, "What the upstream client accepts"): a head's size,
# header count and time from its first byte; a whole non-streamed answer's size and time.
GATEWAY_UPSTREAM_MAX_HEAD_BYTES = env_number(
    "GATEWAY_UPSTREAM_MAX_HEAD_BYTES", default=64 * 1024, minimum=1024, maximum=1024 * 1024
)
GATEWAY_UPSTREAM_MAX_HEADERS = env_number(
    "GATEWAY_UPSTREAM_MAX_HEADERS", default=100, minimum=10, maximum=1000
)
GATEWAY_UPSTREAM_HEAD_TIMEOUT_S = env_number(
    "GATEWAY_UPSTREAM_HEAD_TIMEOUT_S", default=10.0, minimum=0.1, maximum=300.0
)
GATEWAY_UPSTREAM_MAX_ANSWER_BYTES = env_number(
    "GATEWAY_UPSTREAM_MAX_ANSWER_BYTES",
    default=16 * 1024 * 1024,
    minimum=64 * 1024,
    maximum=1024 * 1024 * 1024,
)
GATEWAY_ANSWER_TIMEOUT_S = env_number("GATEWAY_ANSWER_TIMEOUT_S", default=600.0, minimum=1.0, maximum=3600.0)
# Idle pooled connections are dropped before the engine drops them (uvicorn: 5 s keep-alive).
GATEWAY_UPSTREAM_IDLE_S = env_number("GATEWAY_UPSTREAM_IDLE_S", default=4.0, minimum=0.1, maximum=300.0)
GATEWAY_SLOT_LEASE_S = env_number("GATEWAY_SLOT_LEASE_S", default=30.0, minimum=0.3, maximum=3600.0)
# Priority classes (docs/decisions.md): a batch request takes a replica slot only while the
# replica's in-flight count is below this share of its cap, and waits in its own queue this long.
GATEWAY_BATCH_SHARE = env_number("GATEWAY_BATCH_SHARE", default=0.5, minimum=0.0)
if not 0 < GATEWAY_BATCH_SHARE <= 1:
    raise ImproperlyConfigured(f"GATEWAY_BATCH_SHARE={GATEWAY_BATCH_SHARE} must be above 0 and at most 1")
GATEWAY_BATCH_QUEUE_TIMEOUT_S = env_number(
    "GATEWAY_BATCH_QUEUE_TIMEOUT_S", default=120.0, minimum=0.01, maximum=3600.0
)
# Most prompts one /v1/completions request may carry (`"prompt": [...]`); vLLM runs each as a request.
GATEWAY_MAX_PROMPTS = env_number("GATEWAY_MAX_PROMPTS", default=32, minimum=1, maximum=1024)
# Failed authentications per client address per minute before that address gets 429 (for keys
# this process does not already know to be good) instead of a database lookup per guess.
GATEWAY_AUTH_FAILURES_PER_MINUTE = env_number(
    "GATEWAY_AUTH_FAILURES_PER_MINUTE", default=30, minimum=1, maximum=1_000_000
)
# Connect and read timeout of the gateway's Redis calls: a hung Redis answers 503, not a hang.
GATEWAY_REDIS_TIMEOUT_S = env_number("GATEWAY_REDIS_TIMEOUT_S", default=2.0, minimum=0.01, maximum=60.0)
# A slot lease is renewed every third of it, also while its request waits in a queue; a round that
# times out is retried, so the lease covers any queue wait as long as a round fits in it with room to
# spare (docs/decisions.md, "A queued request keeps its concurrency slots").
if GATEWAY_SLOT_LEASE_S < 3 * GATEWAY_REDIS_TIMEOUT_S:
    raise ImproperlyConfigured(
        f"GATEWAY_SLOT_LEASE_S={GATEWAY_SLOT_LEASE_S:g} must be at least 3 × GATEWAY_REDIS_TIMEOUT_S "
        f"({3 * GATEWAY_REDIS_TIMEOUT_S:g}): a renewal that times out must be retried before the lease ends"
    )
# --- Batches (portal/batches, docs/batches.md): OpenAI's Batch API on spare capacity -----------
# An upload's size (its multipart body, read whole: bounded apart from GATEWAY_MAX_BODY_BYTES).
BATCH_FILE_MAX_BYTES = env_number(
    "BATCH_FILE_MAX_BYTES", default=100 * 1024 * 1024, minimum=1024, maximum=1024 * 1024 * 1024
)
BATCH_MAX_LINES = env_number("BATCH_MAX_LINES", default=50_000, minimum=1, maximum=1_000_000)
# One line's bytes; its body must also pass the gateway's own GATEWAY_MAX_BODY_BYTES.
BATCH_LINE_MAX_BYTES = env_number(
    "BATCH_LINE_MAX_BYTES", default=1024 * 1024, minimum=256, maximum=64 * 1024 * 1024
)
# Uploaded and output files are deleted this many days after they were made (0 keeps them).
BATCH_FILE_RETENTION_DAYS = int(
    env_number("BATCH_FILE_RETENTION_DAYS", default=30, minimum=0, maximum=36_500)
)
# Lines of one batch in flight at once (each also waits for the gateway's batch share of a replica).
BATCH_CONCURRENCY = env_number("BATCH_CONCURRENCY", default=16, minimum=1, maximum=1024)
# A batch runner's lease, renewed while it runs: a killed runner's batch is taken over this long after.
BATCH_RUNNER_LEASE_S = env_number("BATCH_RUNNER_LEASE_S", default=30.0, minimum=1.0, maximum=3600.0)
# How often beat looks for batches to validate, run, resume, expire (and wakes waiting ones).
BATCH_DISPATCH_INTERVAL_S = env_number("BATCH_DISPATCH_INTERVAL_S", default=10.0, minimum=0.5, maximum=3600.0)
# A line refused for lack of room (rate limit, queue full or timed out) is sent again after this long
# at least (or the gateway's Retry-After, if longer); it never counts as failed.
BATCH_RETRY_S = env_number("BATCH_RETRY_S", default=2.0, minimum=0.05, maximum=3600.0)
# Hours of the day (in TIME_ZONE) when batches run, "HH:MM-HH:MM" (across midnight allowed); empty:
# always. A team's own window (Team's batch run window) overrides it.
BATCH_RUN_WINDOW = env.str("BATCH_RUN_WINDOW", default="").strip()
_WINDOW_RE = re.compile(r"^([01]\d|2[0-3]):[0-5]\d-([01]\d|2[0-3]):[0-5]\d$")
if BATCH_RUN_WINDOW and not _WINDOW_RE.match(BATCH_RUN_WINDOW):
    raise ImproperlyConfigured(f"BATCH_RUN_WINDOW={BATCH_RUN_WINDOW!r} must be HH:MM-HH:MM, e.g. 20:00-07:00")

# --- Observability (portal/observability): /metrics and the dashboard's traffic history ---
# Bearer token a Prometheus scraper sends to /metrics; unset, /metrics answers 404 (off).
PORTAL_METRICS_TOKEN = env.str("PORTAL_METRICS_TOKEN", default="")
# How often each process adds its in-memory counts to Redis (what a scrape can lag by).
PORTAL_METRICS_FLUSH_S = env_number("PORTAL_METRICS_FLUSH_S", default=1.0, minimum=0.05, maximum=300.0)


# --- Retention: a daily task deletes old rows in batches (portal/dashboard/services.py); 0 keeps forever ---
# Gateway usage records; each UTC day is rolled up into UsageDaily (kept forever) before its
# records go. At least 2: the rollup task recomputes today and yesterday from the records.
RETENTION_USAGE_DAYS = env_retention_days("RETENTION_USAGE_DAYS", default=90, least=2)
# PostgreSQL: days ahead that get their usage partition before they start (portal/teams/partitions.py).
USAGE_PARTITIONS_AHEAD_DAYS = env_positive_int("USAGE_PARTITIONS_AHEAD_DAYS", default=7, maximum=366)
RETENTION_DEPLOYMENT_EVENTS_DAYS = env_retention_days("RETENTION_DEPLOYMENT_EVENTS_DAYS", default=180)
# Supervision and adopted-server health samples (the deployment page charts the latest 60).
RETENTION_METRICS_SAMPLES_DAYS = env_retention_days("RETENTION_METRICS_SAMPLES_DAYS", default=7)
RETENTION_AUDIT_DAYS = env_retention_days("RETENTION_AUDIT_DAYS", default=365)
# Per-minute GPU health samples (the node page charts the last hours).
RETENTION_GPU_SAMPLES_DAYS = env_retention_days("RETENTION_GPU_SAMPLES_DAYS", default=7)
# Rows per DELETE: short statements and transactions, however much has piled up.
RETENTION_BATCH_SIZE = env_positive_int("RETENTION_BATCH_SIZE", default=5000, maximum=100_000)

# --- Rollouts (docs/operators.md "Rollouts"; docs/decisions.md, "Rollouts: steps and what a breach is")
ROLLOUT_TICK_S = env_number("ROLLOUT_TICK_S", default=15, minimum=1, maximum=300)
# Requests the new version must have served in a step before it may pass, and before error rates
# and comparisons with the old version count (an SLA miss counts at once).
ROLLOUT_MIN_REQUESTS = env_number("ROLLOUT_MIN_REQUESTS", default=20, minimum=1, maximum=1_000_000)
# The new version's error rate may exceed the old one's by at most this fraction (0.01: one point).
ROLLOUT_MAX_ERROR_RATE_INCREASE = env_number(
    "ROLLOUT_MAX_ERROR_RATE_INCREASE", default=0.01, minimum=0.0, maximum=1.0
)
# The new version's P95 TTFT and TPOT may be at most this many times the old version's.
ROLLOUT_MAX_LATENCY_RATIO = env_number("ROLLOUT_MAX_LATENCY_RATIO", default=1.5, minimum=1.0, maximum=100.0)
# ... and only when it is also slower by more than the larger of this fraction of the SLA and this many
# ms: a ratio alone turns a busy node's tens of ms into a roll-back (docs/decisions.md, issue 37).
ROLLOUT_LATENCY_MARGIN_SLA_FRACTION = env_number(
    "ROLLOUT_LATENCY_MARGIN_SLA_FRACTION", default=0.1, minimum=0.0, maximum=1.0
)
ROLLOUT_LATENCY_MARGIN_MIN_MS = env_number(
    "ROLLOUT_LATENCY_MARGIN_MIN_MS", default=50.0, minimum=0.0, maximum=600_000.0
)
# An error rate at or above this fails a step whatever the old version does; both versions at or
# above it pause the rollout as an outage.
ROLLOUT_MAX_ERROR_RATE = env_number("ROLLOUT_MAX_ERROR_RATE", default=0.05, minimum=0.001, maximum=1.0)
# A new deployment not serving this long after the rollout started fails the rollout.
ROLLOUT_WARMUP_TIMEOUT_S = env_number("ROLLOUT_WARMUP_TIMEOUT_S", default=1800, minimum=60, maximum=86_400)

# --- Celery beat: every periodic task, in one place --------------------------------
CELERY_BEAT_SCHEDULE = {
    "deployments-supervise": {
        "task": "deployments.supervise_all",
        "schedule": DEPLOYMENT_SUPERVISE_INTERVAL_S,
        # A tick nobody ran in time is worthless: the next one is on its way.
        "options": {"queue": "control", "expires": DEPLOYMENT_SUPERVISE_INTERVAL_S},
    },
    "inventory-agent-heartbeat": {
        "task": "inventory.heartbeat_all",
        "schedule": NODE_HEARTBEAT_INTERVAL_S,
        "options": {"queue": "control", "expires": NODE_HEARTBEAT_INTERVAL_S},
    },
    "gateway-usage-flush": {"task": "portal.teams.tasks.usage_flush", "schedule": 5.0},
    "gateway-usage-rollup": {"task": "portal.teams.tasks.usage_rollup", "schedule": 300.0},
    # Hourly, though the days ahead are made a week early: a missed run costs nothing.
    "gateway-usage-partitions": {
        "task": "portal.teams.tasks.usage_partitions_maintain",
        "schedule": crontab(minute=7),
        "options": {"queue": "control", "expires": 3000},
    },
    "observability-sample-queues": {
        "task": "observability.sample_queues",
        "schedule": 15.0,
        "options": {"queue": "control", "expires": 15.0},
    },
    # Per-deployment latency per minute (P50/P95 TTFT and TPOT) and SLA breaches, from the usage records.
    "observability-latency-rollup": {
        "task": "observability.latency_rollup",
        "schedule": 60.0,
        "options": {"queue": "control", "expires": 60.0},
    },
    # Each active rollout: warm-up, its step's verdict from the latency rollups, the next step.
    "rollouts-advance": {
        "task": "rollouts.advance_all",
        "schedule": ROLLOUT_TICK_S,
        "options": {"queue": "control", "expires": ROLLOUT_TICK_S},
    },
    # An acceptance whose agent died is declared abandoned and its reference server stopped.
    "benchmarks-expire-acceptances": {
        "task": "benchmarks.expire_acceptances",
        "schedule": 60.0,
        "options": {"queue": "control", "expires": 60.0},
    },
    # A benchmark run whose worker died (its lease lapsed) is failed, never left running.
    "benchmarks-expire-runs": {
        "task": "benchmarks.expire_runs",
        "schedule": BENCHMARK_SWEEP_INTERVAL_S,
        "options": {"queue": "control", "expires": BENCHMARK_SWEEP_INTERVAL_S},
    },
    # Every node with GPUs samples their health (inventory.sample_gpu_health on its own queue).
    "inventory-gpu-health": {
        "task": "inventory.sample_gpu_health_all",
        "schedule": GPU_HEALTH_SAMPLE_INTERVAL_S,
        "options": {"queue": "control", "expires": GPU_HEALTH_SAMPLE_INTERVAL_S},
    },
    # Batches: validate new ones, start or resume runners whose lease lapsed, expire, wake waiting ones.
    "batches-dispatch": {
        "task": "batches.dispatch",
        "schedule": BATCH_DISPATCH_INTERVAL_S,
        "options": {"expires": BATCH_DISPATCH_INTERVAL_S},
    },
    "retention-prune": {
        "task": "dashboard.retention_prune",
        "schedule": crontab(hour=3, minute=17),  # daily, at a quiet hour (UTC)
        "options": {"queue": "control", "expires": 6 * 3600},
    },
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env.str("LOG_LEVEL", default="INFO")},
    # httpx logs every request at INFO; node agents poll /health every half second while starting.
    # axes narrates each login failure at INFO; failures and lockouts themselves are WARNINGs.
    "loggers": {"httpx": {"level": "WARNING"}, "axes": {"level": "WARNING"}},
}
