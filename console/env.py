"""Typed readers for environment variables.

Every reader fails loudly with a message that names the variable and the form
it expects, so a wrong value stops the process at start instead of surfacing
later as a confusing error deep inside a library.
"""

import os
import re
import secrets
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from django.core.exceptions import ImproperlyConfigured


class ConfigError(ImproperlyConfigured):
    """A bad environment value; the message says which and what is expected."""


def _raw(name: str) -> str | None:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    return value.strip()


def string(name: str, default: str | None = None) -> str | None:
    value = _raw(name)
    return default if value is None else value


def secret(name: str) -> str | None:
    """Read a secret from NAME, or from the file named by NAME_FILE."""
    value = _raw(name)
    if value is not None:
        return value
    path = _raw(f"{name}_FILE")
    if path is None:
        return None
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(
            f"{name}_FILE={path!r} cannot be read ({exc.strerror}): expected the path of a file holding {name}"
        ) from exc


def boolean(name: str, default: bool) -> bool:
    value = _raw(name)
    if value is None:
        return default
    lowered = value.lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ConfigError(f"{name}={value!r} is not a boolean: expected one of 1/0, true/false, yes/no, on/off")


def number(name: str, default: float, *, minimum: float | None = None, maximum: float | None = None) -> float:
    value = _raw(name)
    if value is None:
        return default
    try:
        parsed = float(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a number: expected a decimal such as {default}") from None
    if minimum is not None and parsed < minimum or maximum is not None and parsed > maximum:
        bounds = f"between {minimum} and {maximum}" if maximum is not None else f"at least {minimum}"
        raise ConfigError(f"{name}={value!r} is out of range: expected a number {bounds}")
    return parsed


def integer(name: str, default: int, *, minimum: int | None = None) -> int:
    value = _raw(name)
    if value is None:
        return default
    try:
        parsed = int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer: expected a whole number such as {default}") from None
    if minimum is not None and parsed < minimum:
        raise ConfigError(f"{name}={value!r} is out of range: expected an integer of at least {minimum}")
    return parsed


def string_list(name: str, default: list[str]) -> list[str]:
    value = _raw(name)
    if value is None:
        return list(default)
    return [item.strip() for item in value.split(",") if item.strip()]


def choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    value = _raw(name)
    if value is None:
        return default
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not known: expected one of {', '.join(choices)}")
    return value


def mapping(name: str, values: tuple[str, ...]) -> dict[str, str]:
    """ "key=value,key=value" as a dict, each value one of `values` (empty when unset)."""
    found: dict[str, str] = {}
    for item in (_raw(name) or "").split(","):
        if not item.strip():
            continue
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not key or value not in values:
            raise ConfigError(
                f"{name}: {item.strip()!r} is not key=value with a value of {', '.join(values)} "
                f"(expected, say, {name}=gpu-oncall={values[0]},sre-leads={values[-1]})"
            )
        found[key] = value
    return found


def all_or_none(what: str, values: dict[str, str | None]) -> bool:
    """Whether every variable of a group that only works whole is set (True) or none is (False); a part of it is an
    error naming the rest."""
    missing = [name for name, value in values.items() if not value]
    if missing and len(missing) < len(values):
        raise ConfigError(f"{what} is half configured: set {', '.join(missing)} too, or none of {', '.join(values)}")
    return not missing


_NAMESPACE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,40}$")


def namespace(name: str, default: str) -> str:
    value = string(name, default)
    if not _NAMESPACE.match(value):
        raise ConfigError(
            f"{name}={value!r} is not a valid namespace: expected lower-case letters, digits, '-' or '_' (at most 41)"
        )
    return value


DATABASE_FORMS = (
    "postgres://user:password@host:5432/dbname, postgres://user@/dbname?host=/socket/folder "
    "or sqlite:///path/to/lifeline.sqlite3"
)


def database(name: str, default: dict) -> dict:
    """Django DATABASES['default'] from a URL such as postgres://u:p@host:5432/db; `default` without one."""
    value = _raw(name)
    if value is None:
        return default
    return database_from_url(value, name)


def database_from_url(value: str, name: str = "DATABASE_URL") -> dict:
    """Django's DATABASES entry for a database URL; `name` says where the value came from in an error."""
    try:
        parts = urlsplit(value)
        port = parts.port
        query = parse_qs(parts.query, strict_parsing=bool(parts.query))
    except ValueError as exc:
        raise ConfigError(f"{name}={value!r} is malformed ({exc}): expected {DATABASE_FORMS}") from None
    scheme = parts.scheme.lower()
    if scheme == "sqlite":
        path = unquote(parts.path)
        if parts.netloc or not path.strip("/"):
            raise ConfigError(f"{name}={value!r} has no file path: expected {DATABASE_FORMS}")
        # sqlite:///var/db.sqlite3 and sqlite:////var/db.sqlite3 both mean the absolute path.
        return _sqlite(Path("/" + path.lstrip("/")))
    if scheme in {"postgres", "postgresql", "pgsql"}:
        dbname = unquote(parts.path.lstrip("/"))
        # libpq's form for a server's socket folder: postgres://user@/dbname?host=/path (the embedded server's).
        host = query.pop("host", [parts.hostname])[-1]
        if not host or not dbname or "/" in dbname:
            raise ConfigError(f"{name}={value!r} needs a host and a database name: expected {DATABASE_FORMS}")
        if query:
            raise ConfigError(f"{name}={value!r}: unknown option {sorted(query)[0]!r}: only host= is understood")
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": dbname,
            "USER": unquote(parts.username or ""),
            "PASSWORD": unquote(parts.password or ""),
            "HOST": host,
            "PORT": str(port or 5432),
            "CONN_MAX_AGE": 60,
            "CONN_HEALTH_CHECKS": True,
        }
    raise ConfigError(f"{name}={value!r} uses an unsupported scheme {parts.scheme!r}: expected {DATABASE_FORMS}")


def _sqlite(path: Path) -> dict:
    return {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": str(path),
        # Several processes (web, Celery, beat) write to one file: WAL lets
        # readers go on while one writes, IMMEDIATE takes the write lock up
        # front so two writers wait instead of failing with "database is locked".
        "OPTIONS": {
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            "transaction_mode": "IMMEDIATE",
            "timeout": 30,
        },
        "TEST": {"NAME": str(path.with_name(f"test_{path.name}"))},
    }


REDIS_FORMS = "redis://host:6379/0, rediss://host:6380/0 or unix:///path/to/redis.sock"


def redis_url(name: str) -> str | None:
    value = _raw(name)
    if value is None:
        return None
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        raise ConfigError(f"{name}={value!r} is malformed ({exc}): expected {REDIS_FORMS}") from None
    if parts.scheme not in {"redis", "rediss", "unix"}:
        raise ConfigError(f"{name}={value!r} uses an unsupported scheme {parts.scheme!r}: expected {REDIS_FORMS}")
    if parts.scheme != "unix" and not parts.hostname:
        raise ConfigError(f"{name}={value!r} has no host: expected {REDIS_FORMS}")
    return value


def secret_key(name: str, fallback_file: Path) -> str:
    """The Django secret key from the environment, else a per-installation file."""
    value = secret(name)
    if value is not None:
        if len(value) < 32:
            raise ConfigError(f"{name} is too short ({len(value)} characters): expected at least 32 random characters")
        return value
    if not fallback_file.exists():
        fallback_file.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(fallback_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process created it first; use theirs
            pass
        else:
            with os.fdopen(fd, "w") as handle:
                handle.write(secrets.token_urlsafe(50))
    return fallback_file.read_text().strip()
