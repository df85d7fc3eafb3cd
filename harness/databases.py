"""Databases for a test run or a benchmark, on the PostgreSQL server DATABASE_URL names.

Migrating Lifeline's schema from zero takes seconds; copying a migrated database takes a fraction of one. So a run
migrates once, into a template database, and every database it needs after that (each test process's, each stack's)
is `CREATE DATABASE … TEMPLATE` of it. The template is made by the first process of a run that asks for it (a file
lock keeps the others of a parallel run waiting) and dropped when the run ends.
"""

import contextlib
import fcntl
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

BASE_DIR = Path(__file__).resolve().parent.parent


def server_url() -> str:
    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith(("postgres://", "postgresql://")):
        raise RuntimeError(f"DATABASE_URL must name a PostgreSQL server here, not {url!r}")
    return url


def with_name(url: str, name: str) -> str:
    """The same server's URL for database `name` (a socket folder's ?host= kept)."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + name))


def _admin(url: str):
    import psycopg

    from console import env

    params = env.database_from_url(url)
    return psycopg.connect(
        host=params["HOST"],
        port=params["PORT"],
        user=params["USER"] or None,
        password=params["PASSWORD"] or None,
        dbname="postgres",
        autocommit=True,
    )


def create(url: str, name: str, template: str | None = None) -> str:
    """CREATE DATABASE name (a copy of `template` when given), replacing one of that name; return its URL."""
    from psycopg import sql

    with _admin(url) as connection:
        connection.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        statement = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template:
            statement += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
        connection.execute(statement)
    return with_name(url, name)


def drop(url: str, name: str) -> None:
    from psycopg import sql

    with _admin(url) as connection:
        connection.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def _migrate(url: str) -> None:
    result = subprocess.run(
        [sys.executable, "manage.py", "migrate", "--no-input", "-v", "0"],
        cwd=BASE_DIR,
        env={**os.environ, "DATABASE_URL": url, "DJANGO_SETTINGS_MODULE": "console.settings"},
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(f"migrating the template database failed:\n{result.stdout[-2000:]}{result.stderr[-3000:]}")


def template(run_id: str, lock_dir: Path) -> str:
    """The name of this run's migrated template database, made on the first call of any process of the run."""
    name = f"lifeline_template_{run_id}"
    ready = lock_dir / f"{name}.ready"
    with open(lock_dir / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not ready.exists():
            url = create(server_url(), name)
            _migrate(url)
            ready.touch()
    return name


@contextlib.contextmanager
def scratch(prefix: str, template_name: str | None = None) -> Iterator[str]:
    """A database of its own on DATABASE_URL's server, copied from `template_name` when given (else empty), dropped
    at the end; yields its URL."""
    url = server_url()
    name = f"{prefix}_{secrets.token_hex(4)}"
    try:
        yield create(url, name, template_name)
    finally:
        drop(url, name)
