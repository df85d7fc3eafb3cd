"""Lifeline settings, read from the environment.

Defaults are the embedded single-machine setup (a PostgreSQL server of its own in
var/postgres, loopback only, DEBUG off). DATABASE_URL and REDIS_URL switch to a
PostgreSQL and a Redis server of yours.
"""

from pathlib import Path

from celery.schedules import crontab

from console import database, env

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(env.string("LIFELINE_VAR_DIR", str(BASE_DIR / "var"))).resolve()

SECRET_KEY = env.secret_key("LIFELINE_SECRET_KEY", VAR_DIR / "secret_key")
DEBUG = env.boolean("LIFELINE_DEBUG", False)
ALLOWED_HOSTS = env.string_list("LIFELINE_ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]"])
CSRF_TRUSTED_ORIGINS = env.string_list("LIFELINE_CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "django_celery_beat",
    "console",
    "recovery",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "console.outage.StoreOutageMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "console.middleware.LoginRateLimit",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "console.urls"
ASGI_APPLICATION = "console.asgi.application"

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
                "console.context_processors.lifeline",
            ],
        },
    },
]

# Without DATABASE_URL: the embedded PostgreSQL (console/database.py), which `manage.py demo` starts.
DATABASES = {"default": env.database("DATABASE_URL", database.django_settings(database.data_dir(VAR_DIR)))}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "cluster"
LOGOUT_REDIRECT_URL = "login"

# --- Single sign-on: OpenID Connect (console/sso.py; docs/operations.md) -----------------------------------------
# Off unless the provider's endpoints and this client's credentials are set; local accounts always work (break-glass).
AUTHENTICATION_BACKENDS = ["django.contrib.auth.backends.ModelBackend", "console.sso.RoleMappingBackend"]
OIDC_OP_AUTHORIZATION_ENDPOINT = env.string("LIFELINE_OIDC_AUTHORIZATION_ENDPOINT")
OIDC_OP_TOKEN_ENDPOINT = env.string("LIFELINE_OIDC_TOKEN_ENDPOINT")
OIDC_OP_USER_ENDPOINT = env.string("LIFELINE_OIDC_USERINFO_ENDPOINT")
OIDC_OP_JWKS_ENDPOINT = env.string("LIFELINE_OIDC_JWKS_ENDPOINT")
OIDC_RP_CLIENT_ID = env.string("LIFELINE_OIDC_CLIENT_ID")
OIDC_RP_CLIENT_SECRET = env.secret("LIFELINE_OIDC_CLIENT_SECRET")
LIFELINE_OIDC = env.all_or_none(
    "single sign-on",
    {
        "LIFELINE_OIDC_AUTHORIZATION_ENDPOINT": OIDC_OP_AUTHORIZATION_ENDPOINT,
        "LIFELINE_OIDC_TOKEN_ENDPOINT": OIDC_OP_TOKEN_ENDPOINT,
        "LIFELINE_OIDC_USERINFO_ENDPOINT": OIDC_OP_USER_ENDPOINT,
        "LIFELINE_OIDC_JWKS_ENDPOINT": OIDC_OP_JWKS_ENDPOINT,
        "LIFELINE_OIDC_CLIENT_ID": OIDC_RP_CLIENT_ID,
        "LIFELINE_OIDC_CLIENT_SECRET": OIDC_RP_CLIENT_SECRET,
    },
)
LIFELINE_OIDC_PROVIDER_NAME = env.string("LIFELINE_OIDC_PROVIDER_NAME", "single sign-on")
LIFELINE_OIDC_USERNAME_CLAIM = env.string("LIFELINE_OIDC_USERNAME_CLAIM", "preferred_username")
LIFELINE_OIDC_ROLE_CLAIM = env.string("LIFELINE_OIDC_ROLE_CLAIM", "groups")
# "idp-group=role,…": which of the provider's groups gives which Lifeline role (the strongest one wins); the roles
# are recovery.roles.ROLES, which cannot be imported before the apps are loaded.
LIFELINE_OIDC_ROLE_MAP = env.mapping("LIFELINE_OIDC_ROLE_MAP", ("operator", "oncall", "manager", "admin"))
LIFELINE_OIDC_LOGOUT_ENDPOINT = env.string("LIFELINE_OIDC_LOGOUT_ENDPOINT")  # the provider's end_session_endpoint
OIDC_RP_SIGN_ALGO = env.string("LIFELINE_OIDC_SIGN_ALGO", "RS256")
OIDC_RP_SCOPES = env.string("LIFELINE_OIDC_SCOPES", "openid email profile")
OIDC_USE_PKCE = True
OIDC_STORE_ID_TOKEN = True  # the hint a sign-out at the provider needs
OIDC_TIMEOUT = 10
OIDC_AUTHENTICATION_CALLBACK_URL = "oidc_authentication_callback"
LOGIN_REDIRECT_URL_FAILURE = "/login/sso/refused/"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
STATIC_ROOT.mkdir(parents=True, exist_ok=True)


def _plotly_bundle_dir() -> Path:
    import plotly

    return Path(plotly.__file__).parent / "package_data"


# Plotly's own pinned bundle ships inside the plotly package: served as vendor/plotly/plotly.min.js.
STATICFILES_DIRS = [BASE_DIR / "static", ("vendor/plotly", _plotly_bundle_dir())]
# Serve static files straight from the finders so the embedded default needs
# no collectstatic step; a production image runs collectstatic instead.
WHITENOISE_USE_FINDERS = True

# --- Production hardening (docs/security.md) --------------------------------
# LIFELINE_PRODUCTION=1 behind a TLS-terminating proxy: secure cookies, HSTS, HTTPS redirects, and
# `manage.py check --deploy` clean. Each part can still be set on its own with the variables below.
LIFELINE_PRODUCTION = env.boolean("LIFELINE_PRODUCTION", False)
if LIFELINE_PRODUCTION and DEBUG:
    raise env.ConfigError("LIFELINE_DEBUG=1 with LIFELINE_PRODUCTION=1: a production console never runs with DEBUG")

SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SECURE = env.boolean("LIFELINE_SECURE_COOKIES", LIFELINE_PRODUCTION)
CSRF_COOKIE_SECURE = SESSION_COOKIE_SECURE
# Lax: a link from elsewhere opens the console logged in; a form posted from elsewhere carries no cookie.
SESSION_COOKIE_SAMESITE = CSRF_COOKIE_SAMESITE = "Lax"
SESSION_COOKIE_AGE = env.integer("LIFELINE_SESSION_AGE_S", 12 * 3600, minimum=300)  # a working day and a bit
SECURE_SSL_REDIRECT = env.boolean("LIFELINE_SSL_REDIRECT", LIFELINE_PRODUCTION)
# Load balancers' health checks, and nodes on the cluster's own network, may speak plain HTTP to the web process.
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^api/nodes/"]
if env.boolean("LIFELINE_BEHIND_TLS_PROXY", LIFELINE_PRODUCTION):
    # The proxy terminates TLS and says so; it must strip this header from what clients send.
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_HSTS_SECONDS = env.integer("LIFELINE_HSTS_SECONDS", 365 * 86400 if LIFELINE_PRODUCTION else 0, minimum=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env.boolean("LIFELINE_HSTS_INCLUDE_SUBDOMAINS", LIFELINE_PRODUCTION)
SECURE_HSTS_PRELOAD = env.boolean("LIFELINE_HSTS_PRELOAD", LIFELINE_PRODUCTION)
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
SECURE_CROSS_ORIGIN_OPENER_POLICY = "same-origin"
X_FRAME_OPTIONS = "DENY"

# Request bodies (console.middleware.BodySizeLimit): larger ones are refused with a 413 before they are read.
# Forms and JSON are small; the largest legitimate body is a node's registration or heartbeat with many GPUs.
LIFELINE_MAX_BODY_BYTES = env.integer("LIFELINE_MAX_BODY_BYTES", 2 * 1024 * 1024, minimum=1024)
DATA_UPLOAD_MAX_MEMORY_SIZE = LIFELINE_MAX_BODY_BYTES
FILE_UPLOAD_MAX_MEMORY_SIZE = LIFELINE_MAX_BODY_BYTES

# Log-in rate limit (console.auth): this many failures for one user name from one address within the window,
# then refused until the window has passed. Counted in the cache (Redis when REDIS_URL is set).
LIFELINE_LOGIN_MAX_FAILURES = env.integer("LIFELINE_LOGIN_MAX_FAILURES", 5, minimum=1)
LIFELINE_LOGIN_WINDOW_S = env.integer("LIFELINE_LOGIN_WINDOW_S", 900, minimum=1)

# --- Redis: hot state, pub/sub, Celery broker and the Channels layer --------
# Every key, channel and queue Lifeline uses is prefixed with the namespace, so
# several installations (or a test run beside a demo) can share one Redis.
LIFELINE_NAMESPACE = env.namespace("LIFELINE_NAMESPACE", "lifeline")
REDIS_URL = env.redis_url("REDIS_URL")

if REDIS_URL:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [REDIS_URL], "prefix": f"{LIFELINE_NAMESPACE}:asgi", "capacity": 1000, "expiry": 30},
        }
    }
else:
    # Without Redis nothing can cross processes; management commands that do
    # not need it (migrate, issue_token) still work, the servers refuse to start.
    CHANNEL_LAYERS = {}

# The cache holds the log-in failure counters: shared by every web process through Redis, else per process.
CACHES = {
    "default": (
        {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": REDIS_URL,
            "KEY_PREFIX": f"{LIFELINE_NAMESPACE}:cache",
            "OPTIONS": {"socket_timeout": 5, "socket_connect_timeout": 5},
        }
        if REDIS_URL
        else {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}
    )
}

CELERY_BROKER_URL = REDIS_URL
CELERY_BROKER_TRANSPORT = "console.broker:Transport"  # kombu's Redis transport, one failure path fixed
CELERY_BROKER_TRANSPORT_OPTIONS = {"global_keyprefix": f"{LIFELINE_NAMESPACE}:celery:"}
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_DEFAULT_QUEUE = f"{LIFELINE_NAMESPACE}-control"
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ACKS_LATE = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_TIMEZONE = "UTC"
CELERY_BEAT_SCHEDULER = "console.beat:Scheduler"  # django-celery-beat's, with a sign of life

# --- Node lifecycle (source document 004) -----------------------------------
LIFELINE_HEARTBEAT_INTERVAL_S = env.number("LIFELINE_HEARTBEAT_INTERVAL_S", 1.0, minimum=0.05, maximum=60)
LIFELINE_HEARTBEAT_MISS_S = env.number("LIFELINE_HEARTBEAT_MISS_S", 3.0, minimum=0.2, maximum=600)
# Every watched node silent at once is the control plane not hearing (its web process restarting, Redis away):
# nobody is marked DOWN for it for this long; a whole fleet that is really gone is declared after it.
LIFELINE_HEARTBEAT_DEAF_MAX_S = env.number("LIFELINE_HEARTBEAT_DEAF_MAX_S", 30.0, minimum=0, maximum=3600)
# Whole seconds: django-celery-beat stores intervals as integers.
LIFELINE_HEARTBEAT_CHECK_S = env.integer("LIFELINE_HEARTBEAT_CHECK_S", 1, minimum=1)
# A node whose decode steps run 1.5 times the model's or slower for this long is a slow GPU: an incident of its own
# (recovery.actions.conditions). Long enough that a busy minute of the host is not one.
LIFELINE_SLOW_GPU_S = env.number("LIFELINE_SLOW_GPU_S", 30.0, minimum=1, maximum=86400)
# A poison request's incident ends after this long with no failure of its content (recovery.actions.conditions).
LIFELINE_POISON_QUIET_S = env.number("LIFELINE_POISON_QUIET_S", 600.0, minimum=1, maximum=86400)
LIFELINE_LEFT_AFTER_S = env.number("LIFELINE_LEFT_AFTER_S", 600.0, minimum=1, maximum=30 * 86400)
# Shared secret nodes present when they register and send heartbeats.
LIFELINE_NODE_TOKEN = env.secret("LIFELINE_NODE_TOKEN")
# Rotating it: the old one, accepted beside the new one until every node has the new one.
LIFELINE_NODE_TOKEN_PREVIOUS = env.secret("LIFELINE_NODE_TOKEN_PREVIOUS")
# Per-node tokens instead (`manage.py node_token NAME`): each speaks only for its own node (docs/security.md).
# Leave LIFELINE_NODE_TOKEN unset to accept per-node tokens only.
LIFELINE_NODE_TOKEN_SECRET = env.secret("LIFELINE_NODE_TOKEN_SECRET")
LIFELINE_NODE_TOKEN_SECRET_PREVIOUS = env.secret("LIFELINE_NODE_TOKEN_SECRET_PREVIOUS")
# What the control plane presents to node agents (assist, migration) and, on staging, fault injection.
LIFELINE_AGENT_TOKEN = env.secret("LIFELINE_AGENT_TOKEN")
LIFELINE_FAULT_TOKEN = env.secret("LIFELINE_FAULT_TOKEN")
LIFELINE_CLUSTER_NAME = env.string("LIFELINE_CLUSTER_NAME", "default")

# --- Telling on-call (drain requests, the cluster breaker) ------------------------
# The console's address as people reach it, for links in webhooks and e-mail.
LIFELINE_CONSOLE_URL = env.string("LIFELINE_CONSOLE_URL", "http://127.0.0.1:8000").rstrip("/")
# E-mail through Django: by default written to files in var/mail (the embedded default has no
# mail server); set LIFELINE_EMAIL_BACKEND=django.core.mail.backends.smtp.EmailBackend and EMAIL_HOST.
EMAIL_BACKEND = env.string("LIFELINE_EMAIL_BACKEND", "django.core.mail.backends.filebased.EmailBackend")
EMAIL_FILE_PATH = VAR_DIR / "mail"
EMAIL_HOST = env.string("EMAIL_HOST", "localhost")
EMAIL_PORT = env.integer("EMAIL_PORT", 25, minimum=1)
EMAIL_HOST_USER = env.string("EMAIL_HOST_USER", "")
EMAIL_HOST_PASSWORD = env.secret("EMAIL_HOST_PASSWORD") or ""
EMAIL_USE_TLS = env.boolean("EMAIL_USE_TLS", False)
DEFAULT_FROM_EMAIL = env.string("LIFELINE_FROM_EMAIL", "lifeline@localhost")

# --- Service-level objectives (recovery.actions.slo) -----------------------------
# Raw request outcomes are kept this long, then pruned (once rolled up); the per-minute rollups 13 months.
LIFELINE_OUTCOME_RETENTION_DAYS = env.integer("LIFELINE_OUTCOME_RETENTION_DAYS", 30, minimum=1)
# A page-severity burn-rate alert needs at least this many valid requests in its long window.
LIFELINE_SLO_MIN_VALID_FOR_PAGE = env.integer("LIFELINE_SLO_MIN_VALID_FOR_PAGE", 100, minimum=0)

CELERY_BEAT_SCHEDULE = {
    # What follows every committed change (spares, drains proposed, incident timelines, assist): recovery.reactions.
    "react": {
        "task": "recovery.reactions.react",
        "schedule": 1.0,
        "options": {"expires": 5.0},
    },
    # MoE deployments: expert workers polled, a lost one confirmed, the table healed and pushed, a standby provisioned.
    "watch-moe": {
        "task": "recovery.tasks.watch_moe",
        "schedule": 1.0,
        "options": {"expires": 3.0},
    },
    "check-heartbeats": {
        "task": "recovery.tasks.check_heartbeats",
        "schedule": LIFELINE_HEARTBEAT_CHECK_S,
        "options": {"expires": 5 * LIFELINE_HEARTBEAT_CHECK_S},
    },
    "sync-hot-state": {
        "task": "recovery.tasks.sync_hot_state",
        "schedule": 30.0,
        "options": {"expires": 30.0},
    },
    # Redis restarted empty: the routing table, keys and settings are written again within a second.
    "restore-hot-state": {
        "task": "recovery.tasks.restore_hot_state",
        "schedule": 1.0,
        "options": {"expires": 2.0},
    },
    "process-gateway-streams": {
        "task": "recovery.tasks.process_gateway_streams",
        "schedule": 1.0,
        "options": {"expires": 5.0},
    },
    # Failures that last (recovery.actions.conditions): slow GPUs, lost gateways, poison requests gone quiet.
    "check-conditions": {
        "task": "recovery.tasks.check_conditions",
        "schedule": 2.0,
        "options": {"expires": 4.0},
    },
    "check-incident-recovery": {
        "task": "recovery.tasks.check_incident_recovery",
        "schedule": 2.0,
        "options": {"expires": 10.0},
    },
    # A promoted hot spare back to the pool once the node it stood in for serves again (recovery.actions.health).
    "return-spares": {
        "task": "recovery.tasks.return_spares",
        "schedule": 2.0,
        "options": {"expires": 4.0},
    },
    # Each node's canary comes due at the cluster's interval (settings page); this only looks for due ones.
    "schedule-canaries": {
        "task": "recovery.tasks.schedule_canaries",
        "schedule": 1.0,
        "options": {"expires": 2.0},
    },
    "evaluate-capacity": {
        "task": "recovery.tasks.evaluate_capacity",
        "schedule": 2.0,
        "options": {"expires": 4.0},
    },
    "advance-drains": {
        "task": "recovery.tasks.advance_drains",
        "schedule": 1.0,
        "options": {"expires": 2.0},
    },
    # A node left out of service after its drain was cancelled or rejected: the drain again, after the hold-off.
    "propose-drains-again": {
        "task": "recovery.tasks.propose_drains_again",
        "schedule": 5.0,
        "options": {"expires": 5.0},
    },
    # Request outcomes into per-minute SLO rollups; incremental and idempotent (recovery.actions.slo).
    "roll-up-outcomes": {
        "task": "recovery.tasks.roll_up_outcomes",
        "schedule": 5.0,
        "options": {"expires": 10.0},
    },
    "prune-outcomes": {
        "task": "recovery.tasks.prune_outcomes",
        "schedule": 3600.0,
        "options": {"expires": 600.0},
    },
    # Last week's SLA report, with its PDF, to every manager with an e-mail address (console.exports.mail_report).
    "mail-weekly-report": {
        "task": "console.tasks.mail_weekly_report",
        "schedule": crontab(minute=0, hour=6, day_of_week="mon"),
        "options": {"expires": 6 * 3600.0},
    },
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {
        "handlers": ["stderr"],
        "level": env.choice("LIFELINE_LOG_LEVEL", "INFO", ("DEBUG", "INFO", "WARNING", "ERROR")),
    },
    "loggers": {
        "django.channels.server": {"level": "WARNING"},
        "daphne": {"level": "WARNING"},
        # One line per periodic task is noise; failures still show.
        "celery.beat": {"level": "WARNING"},
        "celery.app.trace": {"level": "WARNING"},
        "celery.worker.strategy": {"level": "WARNING"},
    },
}
