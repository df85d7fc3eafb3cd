"""Pytest plugin (loaded with -p before Django): the services the tests talk to.

With REDIS_URL and DATABASE_URL set (as .ci/run does), the tests use that Redis and that PostgreSQL. Without them
they start their own, the same servers `./lifeline run` embeds: a PostgreSQL (console/database.py) and a Redis, so
`./lifeline test` on a machine with nothing set up runs what CI runs, on the database production runs. Every key,
queue and channel the tests touch lives under a namespace of their own, so a running demo or another suite on the
same Redis is left alone.

A parallel run (pytest-xdist) starts the servers once, in the process that hands out the tests; its workers use
them, each under a namespace and a var folder of its own.
"""

import atexit
import os
import secrets
import shutil
import tempfile
from pathlib import Path

import pytest

_state: dict = {}


def worker_id() -> str | None:
    """This xdist worker's id (gw0, gw1, …), or None in a serial run and in the process that hands out tests."""
    return os.environ.get("PYTEST_XDIST_WORKER")


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    worker = worker_id()
    if worker is not None:  # the services and the run's names were set by the process that started us
        os.environ["LIFELINE_NAMESPACE"] = f"{os.environ['LIFELINE_NAMESPACE']}-{worker}"
        var_dir = Path(os.environ["LIFELINE_TEST_SHARED_DIR"]) / worker
        var_dir.mkdir(exist_ok=True)
        os.environ["LIFELINE_VAR_DIR"] = str(var_dir)
        return
    run_id = secrets.token_hex(3)
    os.environ["LIFELINE_TEST_RUN"] = run_id
    os.environ["LIFELINE_NAMESPACE"] = f"test-{run_id}"
    var_dir = Path(tempfile.mkdtemp(prefix="lifeline-test-"))
    os.environ["LIFELINE_VAR_DIR"] = str(var_dir)
    os.environ["LIFELINE_TEST_SHARED_DIR"] = str(var_dir)  # the run's locks and its workers' var folders
    os.environ.setdefault("LIFELINE_NODE_TOKEN", "test-node-token-" + run_id)
    _state["var_dir"] = var_dir
    if os.environ.get("REDIS_URL") and os.environ.get("DATABASE_URL"):
        return
    from console.stack import Supervisor

    supervisor = Supervisor(var_dir / "log")
    _state["supervisor"] = supervisor
    atexit.register(supervisor.stop)
    if not os.environ.get("DATABASE_URL"):
        from console.stack import start_embedded_postgres

        # Outside var/ (a private temporary folder): the server may run as `nobody`, which must reach its data.
        server_dir = Path(tempfile.mkdtemp(prefix="lifeline-test-postgres-"))
        server_dir.chmod(0o755)
        _state["server_dir"] = server_dir
        os.environ["DATABASE_URL"] = start_embedded_postgres(supervisor, server_dir / "data")
    if not os.environ.get("REDIS_URL"):
        from console.stack import start_embedded_redis

        os.environ["REDIS_URL"] = start_embedded_redis(supervisor, var_dir / "redis")


def pytest_unconfigure(config):
    """Leave the shared servers as we found them: drop every key under our namespace and the run's template
    database; stop the servers we started."""
    if worker_id() is not None:
        return
    supervisor = _state.pop("supervisor", None)
    template_ready = list(Path(os.environ.get("LIFELINE_TEST_SHARED_DIR", "/nonexistent")).glob("*.ready"))
    if template_ready and os.environ.get("DATABASE_URL"):
        from harness import databases

        try:
            for marker in template_ready:
                databases.drop(databases.server_url(), marker.name.removesuffix(".ready"))
        except Exception as exc:  # noqa: BLE001 - a server already gone leaves nothing to drop
            print(f"could not drop the run's template database: {exc}")
    url = os.environ.get("REDIS_URL")
    if url and not (supervisor and "redis" in supervisor.children):
        import redis

        client = redis.Redis.from_url(url)
        try:
            for key in client.scan_iter(match=os.environ["LIFELINE_NAMESPACE"] + "*", count=500):
                client.delete(key)
        except redis.RedisError:
            pass
    if supervisor is not None:
        supervisor.stop()
    server_dir = _state.pop("server_dir", None)
    if server_dir is not None:
        shutil.rmtree(server_dir, ignore_errors=True)
