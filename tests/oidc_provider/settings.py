"""The identity provider's settings: django-oauth-toolkit with OpenID Connect on, its RSA key and its database
(SQLite) in the folder serve.py is given."""

import os
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = Path(os.environ["OIDC_PROVIDER_DATA"])

SECRET_KEY = "test-identity-provider-not-a-secret"
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
ROOT_URLCONF = "tests.oidc_provider.urls"
INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "oauth2_provider",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [HERE / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {"context_processors": ["django.template.context_processors.request"]},
    }
]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": DATA / "provider.sqlite3"}}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # test users only
USE_TZ = True
LOGIN_URL = "/accounts/login/"
SESSION_COOKIE_NAME = "idp_session"  # the console's runs on the same host name: each keeps its own
CSRF_COOKIE_NAME = "idp_csrftoken"
OAUTH2_PROVIDER = {
    "OIDC_ENABLED": True,
    "OIDC_RSA_PRIVATE_KEY": (DATA / "signing-key.pem").read_text() if (DATA / "signing-key.pem").exists() else "",
    "OAUTH2_VALIDATOR_CLASS": "tests.oidc_provider.claims.GroupsValidator",
    "SCOPES": {
        "openid": "Your identity",
        "profile": "Your name and user name",
        "email": "Your e-mail address",
        "groups": "The groups you belong to",
    },
    "PKCE_REQUIRED": True,
    "OIDC_RP_INITIATED_LOGOUT_ENABLED": True,
    "OIDC_RP_INITIATED_LOGOUT_ALWAYS_PROMPT": False,
}
