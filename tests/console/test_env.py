"""Settings from the environment: good values parse, bad ones fail at start with a clear message."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from console import database, env
from tests.helpers import BASE_DIR


@pytest.fixture
def environ(monkeypatch):
    def set_(**values):
        for key, value in values.items():
            monkeypatch.setenv(key, value)

    return set_


def test_postgres_url(environ):
    environ(DATABASE_URL="postgres://ops:s%40cret@db.internal:6543/lifeline")
    db = env.database("DATABASE_URL", {})
    assert db["ENGINE"] == "django.db.backends.postgresql"
    assert (db["HOST"], db["PORT"], db["NAME"], db["USER"], db["PASSWORD"]) == (
        "db.internal",
        "6543",
        "lifeline",
        "ops",
        "s@cret",
    )


def test_postgres_socket_folder_url(environ):
    """libpq's form for a server reached through its socket folder, as the embedded PostgreSQL is."""
    environ(DATABASE_URL="postgres://postgres@/lifeline_e2e?host=/tmp/some%20dir/postgres")
    db = env.database("DATABASE_URL", {})
    assert (db["HOST"], db["NAME"], db["USER"]) == ("/tmp/some dir/postgres", "lifeline_e2e", "postgres")
    environ(DATABASE_URL="postgres://postgres@/lifeline?host=/tmp/pg&sslmode=require")
    with pytest.raises(env.ConfigError, match="unknown option 'sslmode'"):
        env.database("DATABASE_URL", {})


def test_sqlite_url_and_default(environ, monkeypatch, tmp_path):
    environ(DATABASE_URL=f"sqlite:///{tmp_path}/a.sqlite3")
    assert env.database("DATABASE_URL", {})["NAME"] == f"{tmp_path}/a.sqlite3"
    monkeypatch.delenv("DATABASE_URL")
    assert env.database("DATABASE_URL", {"NAME": "the default"}) == {"NAME": "the default"}


def test_the_default_database_is_the_embedded_postgresql(tmp_path):
    """Without DATABASE_URL every process of a checkout uses the PostgreSQL server in its var/ (./lifeline run
    starts it), never a SQLite file: the default run is CI's and production's database."""
    environ = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    environ["LIFELINE_VAR_DIR"] = str(tmp_path)
    code = "from django.conf import settings; import json; print(json.dumps(settings.DATABASES['default']))"
    result = subprocess.run(
        [sys.executable, "-c", f"import django; django.setup(); {code}"],
        cwd=BASE_DIR,
        env={**environ, "DJANGO_SETTINGS_MODULE": "console.settings"},
        capture_output=True,
        text=True,
        check=True,
    )
    db = json.loads(result.stdout)
    assert db["ENGINE"] == "django.db.backends.postgresql"
    assert (db["HOST"], db["NAME"]) == (str(database.data_dir(tmp_path)), "lifeline")


def test_the_embedded_server_keeps_its_data_where_the_account_it_runs_as_can_reach(tmp_path):
    """var/postgres; but PostgreSQL will not run as root, and as root the server runs as `nobody`, which cannot
    pass a private folder (pytest's own, or a checkout in /root): its data then go to a folder of their own, the
    same one for the same var/ every time."""
    reachable = Path(tempfile.mkdtemp())
    try:
        reachable.chmod(0o755)
        assert database.data_dir(reachable / "var") == reachable / "var" / "postgres"
    finally:
        reachable.rmdir()
    private = tmp_path / "var"  # under pytest's folder, which only its owner may enter
    if os.geteuid() != 0:
        assert database.data_dir(private) == private / "postgres"
    else:
        elsewhere = database.data_dir(private)
        assert elsewhere.parent == Path(tempfile.gettempdir()) and elsewhere == database.data_dir(private)
        assert database.data_dir(tmp_path / "other") != elsewhere


@pytest.mark.parametrize(
    "url",
    [
        "mysql://root@localhost/db",
        "postgres://host-only",
        "postgres://:5432/db",
        "sqlite://",
        "postgres://h:notaport/db",
        "just words",
    ],
)
def test_malformed_database_url_names_the_variable_and_the_form(environ, url):
    environ(DATABASE_URL=url)
    with pytest.raises(env.ConfigError) as excinfo:
        env.database("DATABASE_URL", {})
    message = str(excinfo.value)
    assert message.startswith("DATABASE_URL=") and "expected postgres://" in message and "sqlite:///" in message


@pytest.mark.parametrize("url", ["http://localhost:6379", "redis://:bad/0", "redis:///0"])
def test_malformed_redis_url(environ, url):
    environ(REDIS_URL=url)
    with pytest.raises(env.ConfigError, match=r"^REDIS_URL=.*expected redis://"):
        env.redis_url("REDIS_URL")


def test_typed_readers(environ):
    environ(A="2.5", B="yes", C="a, b,,c", D="7")
    assert env.number("A", 1.0) == 2.5
    assert env.boolean("B", False) is True
    assert env.string_list("C", []) == ["a", "b", "c"]
    assert env.integer("D", 1, minimum=1) == 7
    environ(A="fast", B="maybe", D="0")
    with pytest.raises(env.ConfigError, match="A='fast' is not a number"):
        env.number("A", 1.0)
    with pytest.raises(env.ConfigError, match="B='maybe' is not a boolean"):
        env.boolean("B", False)
    with pytest.raises(env.ConfigError, match="D='0' is out of range"):
        env.integer("D", 1, minimum=1)


def test_secret_from_file(environ, tmp_path):
    (tmp_path / "token").write_text("s3cret\n")
    environ(TOKEN_FILE=str(tmp_path / "token"))
    assert env.secret("TOKEN") == "s3cret"
    environ(TOKEN_FILE=str(tmp_path / "missing"))
    with pytest.raises(env.ConfigError, match="TOKEN_FILE=.* cannot be read"):
        env.secret("TOKEN")


def _manage(*args, **extra_env):
    environ = {**os.environ, **extra_env}
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=BASE_DIR, env=environ, capture_output=True, text=True, timeout=60
    )


def test_bad_database_url_stops_the_process_with_a_message_not_a_traceback():
    result = _manage("check", DATABASE_URL="mysql://root@localhost/lifeline")
    assert result.returncode == 2
    assert (
        "configuration error: DATABASE_URL='mysql://root@localhost/lifeline' uses an unsupported scheme"
        in result.stderr
    )
    assert "Traceback" not in result.stderr


def test_unknown_process_role_is_refused_with_the_choices():
    result = _manage("serve", LIFELINE_ROLE="scheduler")
    assert result.returncode != 0
    assert "LIFELINE_ROLE='scheduler' is not a role: expected one of web, worker, beat, gateway, node" in result.stderr


def test_bad_number_in_settings_names_the_variable():
    result = _manage("check", LIFELINE_HEARTBEAT_MISS_S="soon")
    assert result.returncode == 2
    assert "LIFELINE_HEARTBEAT_MISS_S='soon' is not a number" in result.stderr


def _fake_checkout(tmp_path, with_uv: bool) -> dict:
    """The lifeline script beside a .venv whose python (and uv) only record what they were asked to do."""
    import shutil

    shutil.copy(BASE_DIR / "lifeline", tmp_path / "lifeline")
    shutil.copy(BASE_DIR / "pyproject.toml", tmp_path / "pyproject.toml")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("python", "uv") if with_uv else ("python",):
        fake = bin_dir / name
        fake.write_text(f'#!/bin/sh\necho "{name} $*" >> "$(dirname "$0")/../../calls"\n')
        fake.chmod(0o755)
    return {**os.environ, "LIFELINE_CHROMIUM": "/bin/true"}  # never install a browser from a test


def _lifeline(tmp_path, environ, command) -> str:
    result = subprocess.run(
        ["./lifeline", command], cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_switching_between_run_and_test_installs_once_each(tmp_path):
    """`./lifeline run` then `./lifeline test` then `run` again: the test extras serve both, nothing is reinstalled;
    uv installs (in seconds where pip takes a minute and a half)."""
    environ = _fake_checkout(tmp_path, with_uv=True)
    for command in ("run", "test", "run", "test", "run"):
        _lifeline(tmp_path, environ, command)
    installs = [line for line in (tmp_path / "calls").read_text().splitlines() if " install " in line]
    assert installs == [
        "uv pip install --quiet --python .venv/bin/python -e .",
        "uv pip install --quiet --python .venv/bin/python -e .[test]",
    ]
    (tmp_path / "pyproject.toml").write_text((BASE_DIR / "pyproject.toml").read_text() + "\n# changed\n")
    assert "installing dependencies" in _lifeline(tmp_path, environ, "run")  # a changed project: installed again,
    assert (tmp_path / "calls").read_text().splitlines()[-2].endswith("-e .[test]")  # with the extras kept


def test_where_uv_cannot_be_had_pip_installs(tmp_path):
    """No uv in the virtualenv and none installed by pip (this fake pip installs nothing): pip installs the project."""
    environ = _fake_checkout(tmp_path, with_uv=False)
    _lifeline(tmp_path, environ, "run")
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls[:2] == [
        "python -m pip install --quiet --disable-pip-version-check uv==0.13.9",
        "python -m pip install --quiet --disable-pip-version-check -e .",
    ]
