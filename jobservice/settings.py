"""Settings, all from the environment (SPEC §9). Defaults suit development."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import django
import environ

from jobs import conf
from jobservice import observability

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()

DEBUG = env.bool("DEBUG", default=False)
PRODUCTION = env.bool("JOBS_PRODUCTION", default=False)

if PRODUCTION:
    _missing = [k for k in ("SECRET_KEY", "DATABASE_URL", "REDIS_URL") if not env.str(k, "")]
    if _missing:
        raise SystemExit(f"jobservice: production needs {', '.join(_missing)} in the environment")

SECRET_KEY = env.str("SECRET_KEY", default="dev-insecure-" + "x" * 50)
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "[::1]"])
# Origins (scheme://host) allowed to POST forms, e.g. the admin behind a TLS proxy.
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])

# Keys a deployment must never run with: the development default, Django's
# generated placeholder, and anything short or repetitive (Django's own bar).
_WEAK_KEY_PREFIXES = ("dev-insecure-", "django-insecure-")
_WEAK_KEYS = {"changeme", "change-me", "secret", "secret-key", "please-change-me"}


def weak_secret_key_reason(key: str) -> str | None:
    """Why `key` is unfit for production, or None when it is acceptable."""
    if key.lower() in _WEAK_KEYS or key.lower().startswith(_WEAK_KEY_PREFIXES):
        return "it is a default or placeholder value"
    if len(key) < 50:
        return f"it has {len(key)} characters (at least 50 needed)"
    if len(set(key)) < 5:
        return "it has fewer than 5 distinct characters"
    return None


if PRODUCTION:
    _weak = weak_secret_key_reason(SECRET_KEY)
    if _weak:
        raise SystemExit(
            f"jobservice: SECRET_KEY is too weak for production: {_weak}. Generate one with "
            "python -c 'import secrets; print(secrets.token_urlsafe(64))'"
        )

INSTALLED_APPS = [
    # Before the admin: jobs' admin/index.html adds the job dashboard's link to its index.
    "jobs",
    "jobservice.apps.AdminConfig",  # django.contrib.admin, lazy in runworker (D137)
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.postgres",  # the Job model's ArrayField (Django 6 refuses it without)
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_prometheus",
    # The Tasks framework backport on Django 5.2; Django 6 has it built in (django.tasks).
    *(["django_tasks"] if django.VERSION < (6,) else []),
    "demo",
    # Your own apps with models (e.g. the transactional tasks' tables): JOBS_EXTRA_APPS=myapp
    *env.list("JOBS_EXTRA_APPS", default=[]),
]

MIDDLEWARE = [
    "jobservice.middleware.RefuseBadContentLength",
    "django_prometheus.middleware.PrometheusBeforeMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    # Django's session, auth and messages middleware, skipped under /api/ (token
    # authenticated, no cookies): see jobservice/middleware.py.
    "jobservice.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "jobservice.middleware.AuthenticationMiddleware",
    "jobservice.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "jobservice.middleware.PrometheusAfterMiddleware",
    "jobservice.middleware.RefuseUnknownLength",
]

ROOT_URLCONF = "jobservice.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        # The deployment's own pages (its front page, the admin's branding, the error
        # pages) in the top-level templates/; the app's admin pages come with the app
        # (jobs/templates, through APP_DIRS), so the wheel carries them and not these.
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

WSGI_APPLICATION = "jobservice.wsgi.application"

if env.str("DATABASE_URL", ""):
    DATABASES = {"default": env.db("DATABASE_URL")}
else:
    from jobservice.embedded import database_settings

    DATABASES = {"default": database_settings(BASE_DIR)}
DATABASES["default"].setdefault("CONN_MAX_AGE", env.int("DB_CONN_MAX_AGE", default=60))
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
# Django's backend, its health check without a round trip when nothing says the
# connection broke (jobservice/postgresql).
if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    DATABASES["default"]["ENGINE"] = "jobservice.postgresql"
# Behind PgBouncer in transaction mode (JOBS_DIRECT_DATABASE_URL set: DATABASE_URL is the
# pooler), named (server-side) cursors cannot span transactions: off there by default.
_DIRECT = env.str("JOBS_DIRECT_DATABASE_URL", "")
_POOLED = bool(_DIRECT) and _DIRECT != env.str("DATABASE_URL", "")
DATABASES["default"]["DISABLE_SERVER_SIDE_CURSORS"] = env.bool(
    "DB_DISABLE_SERVER_SIDE_CURSORS", default=_POOLED
)
# Named prepared statements (the worker's hot path asks for them, D23): on by default
# straight to PostgreSQL, off by default behind a pooler (JOBS_DIRECT_DATABASE_URL names
# another address), where they need PgBouncer >= 1.21 with max_prepared_statements;
# DB_PREPARED_STATEMENTS=0/1 says otherwise. Off, the hot path is bound on the server
# unnamed, which any pooler passes (D146), and parsed and planned per statement: 40% of
# a durable step's server CPU (D392).
_PREPARED = env.str("DB_PREPARED_STATEMENTS", "").strip()
if env.bool("DB_PREPARED_STATEMENTS") if _PREPARED else not _POOLED:
    DATABASES["default"].setdefault("OPTIONS", {})["prepare_threshold"] = 5
DATABASES["default"].setdefault("TEST", {})
# A streaming replica for reads that may lag (listings, history, admin lists, scrapes,
# reports; jobs/replica.py, D147): same engine and options as the primary, never
# migrated, never written.
if env.str("DATABASE_REPLICA_URL", ""):
    DATABASES["replica"] = {
        **{k: v for k, v in DATABASES["default"].items() if k not in ("TEST",)},
        **{k: v for k, v in env.db("DATABASE_REPLICA_URL").items() if k != "ENGINE"},
        "TEST": {"MIRROR": "default"},
    }
    # An unreachable replica must cost a request seconds, not the TCP timeout (D148).
    DATABASES["replica"]["OPTIONS"] = {
        **DATABASES["replica"].get("OPTIONS", {}),
        "connect_timeout": env.int("DB_REPLICA_CONNECT_TIMEOUT", default=2),
    }
    DATABASE_ROUTERS = ["jobs.replica.ReplicaRouter"]

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

# Development prints mail to stderr; a deployment sets EMAIL_BACKEND (and EMAIL_HOST, ...).
EMAIL_BACKEND = env.str(
    "EMAIL_BACKEND",
    default="django.core.mail.backends."
    + ("smtp.EmailBackend" if PRODUCTION else "console.EmailBackend"),
)
EMAIL_HOST = env.str("EMAIL_HOST", default="localhost")
EMAIL_PORT = env.int("EMAIL_PORT", default=25)

STATIC_URL = "static/"
STATIC_ROOT = Path(env.str("STATIC_ROOT", default=str(BASE_DIR / "staticfiles")))

# --- the job system (SPEC §9) -------------------------------------------------
# Every setting of the jobs app, with its default, is in jobs/conf.py (docs/settings.md):
# each is set here from the environment variable of the same name, read as its default's
# type (JOBS_QUEUES as JSON text, JOBS_TASK_MODULES comma-separated), else its default.
_jobs = {name: setting.default for name, setting in conf.SETTINGS.items()}
_jobs.update(conf.from_environment(env, skip=frozenset({"PRODUCTION", "LOG_FORMAT"})))
_jobs.pop("PRODUCTION"), _jobs.pop("LOG_FORMAT")  # set above and below
globals().update(_jobs)
REDIS_URL = _jobs["REDIS_URL"]
JOBS_REDIS_PREFIX = _jobs["JOBS_REDIS_PREFIX"]
JOBS_CLIENT_CACHE_SECONDS = _jobs["JOBS_CLIENT_CACHE_SECONDS"]
# Django's Tasks framework runs on jobservice (jobs/backends.py). A @task's module must
# also be in JOBS_TASK_MODULES so that runworker knows it.
TASKS = {
    "default": {
        "BACKEND": "jobs.backends.JobServiceBackend",
        "QUEUES": env.list("JOBS_TASKS_QUEUES", default=["default"]),
        "OPTIONS": {},
    }
}

# --- API ------------------------------------------------------------------------
# Active API clients by token hash (jobs/clientcache.py): shared through Redis so a
# deactivation reaches every process at once; without Redis, no cache.
CACHES = {
    # Per process: the admin dashboard (the API throttle counts in jobs.api.auth).
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    "api_clients": (
        {
            "BACKEND": "jobs.transport.RedisCache",  # Django's, one client per pool
            "LOCATION": REDIS_URL,
            "KEY_PREFIX": f"{JOBS_REDIS_PREFIX}client",
            "TIMEOUT": JOBS_CLIENT_CACHE_SECONDS,
            # A stalled Redis costs a request this much before the database answers.
            "OPTIONS": {"socket_timeout": 0.25, "socket_connect_timeout": 0.25},
        }
        if REDIS_URL and JOBS_CLIENT_CACHE_SECONDS > 0
        else {"BACKEND": "django.core.cache.backends.dummy.DummyCache"}
    ),
}
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["jobs.api.auth.ClientTokenAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["jobs.api.auth.IsClient"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_FILTER_BACKENDS": ["django_filters.rest_framework.DjangoFilterBackend"],
    "DEFAULT_THROTTLE_CLASSES": ["jobs.api.auth.ClientRateThrottle"],
    # One error shape for every API view, the schema and docs views included.
    "EXCEPTION_HANDLER": "jobs.api.errors.exception_handler",
    "DEFAULT_THROTTLE_RATES": {"client": env.str("JOBS_API_THROTTLE", default="100000/minute")},
    "UNAUTHENTICATED_USER": None,
    "DEFAULT_CONTENT_NEGOTIATION_CLASS": "jobs.api.renderers.JSONFirstNegotiation",
    "DEFAULT_RENDERER_CLASSES": [
        "jobs.api.renderers.ORJSONRenderer",
        "rest_framework.renderers.BrowsableAPIRenderer",
    ],
}
SPECTACULAR_SETTINGS = {
    "TITLE": "jobservice API",
    "DESCRIPTION": "Submit asynchronous jobs; PostgreSQL holds the truth, Redis signals workers.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # Swagger UI's assets are served from this process (no CDN): the docs work offline.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # Two `status` enums: a job's five states and a workflow's three.
    "ENUM_NAME_OVERRIDES": {
        "JobStatusEnum": "jobs.lifecycle.STATUSES",
        "WorkflowStatusEnum": "jobs.api.workflows.WORKFLOW_STATUSES",
    },
}

LOG_FORMAT = env.str("LOG_FORMAT", default="json" if PRODUCTION else "text")
LOG_LEVEL = env.str("LOG_LEVEL", default="INFO")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "json": {"()": "jobs.logconfig.JsonFormatter"},
        "text": {"()": "jobs.logconfig.TextFormatter"},
    },
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "stream": sys.stderr,
            "formatter": LOG_FORMAT,
        },
    },
    "root": {"handlers": ["console"], "level": "WARNING"},
    "loggers": {
        "jobs": {"handlers": ["console"], "level": LOG_LEVEL, "propagate": False},
    },
}

# Traces to an OTLP collector and errors to Sentry, when their variables are set
# (docs/observability.md); log lines carry trace_id/span_id and the running job.
LOGGING["filters"] = {"jobs": {"()": "jobs.observability.logs.JobContextFilter"}}
LOGGING["handlers"]["console"]["filters"] = ["jobs"]
observability.configure_tracing()
observability.configure_sentry()

if LOG_FORMAT == "json":
    # Python warnings (a library's UserWarning) go out as JSON log lines too, through
    # the py.warnings logger and the root handler, instead of raw text on stderr.
    logging.captureWarnings(True)

if PRODUCTION:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_SSL_REDIRECT = env.bool("SECURE_SSL_REDIRECT", default=True)
    # Prometheus and the orchestrator's probes speak plain HTTP to the container.
    SECURE_REDIRECT_EXEMPT = [r"^metrics$", r"^healthz$", r"^readyz$"]
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_HSTS_SECONDS = env.int("SECURE_HSTS_SECONDS", default=31_536_000)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = True
    SECURE_CONTENT_TYPE_NOSNIFF = True
    # Probes and scrapes come over plain HTTP from inside the deployment (compose
    # health checks, Prometheus); they must not be redirected to https.
    SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$", r"^metrics$"]
    SESSION_COOKIE_HTTPONLY = True
    X_FRAME_OPTIONS = "DENY"
    # Hashed, compressed static files built by `collectstatic` at image build time and
    # served by whitenoise, so the admin works under gunicorn without a separate web server.
    STORAGES = {
        "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
        "staticfiles": {
            "BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage",
        },
    }
