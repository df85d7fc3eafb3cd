"""Pytest plugin (loaded with -p before Django): the services the tests talk to.

With REDIS_URL and DATABASE_URL set (as .ci/run does), the tests use that
Redis and that PostgreSQL. Without them they use SQLite and a private Redis
started here, so `./lifeline test` works on a machine with nothing set up.
Every key, queue and channel the tests touch lives under a namespace of
their own, so a running demo or another suite on the same Redis is left alone.
"""

import atexit
import os
import secrets
import tempfile
from pathlib import Path

import pytest

_state: dict = {}


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    run_id = secrets.token_hex(3)
    os.environ["LIFELINE_NAMESPACE"] = f"test-{run_id}"
    var_dir = Path(tempfile.mkdtemp(prefix="lifeline-test-"))
    os.environ["LIFELINE_VAR_DIR"] = str(var_dir)
    os.environ.setdefault("LIFELINE_NODE_TOKEN", "test-node-token-" + run_id)
    _state["var_dir"] = var_dir
    if not os.environ.get("REDIS_URL"):
        from console.stack import Supervisor, start_embedded_redis

        supervisor = Supervisor(var_dir / "log")
        os.environ["REDIS_URL"] = start_embedded_redis(supervisor, var_dir / "redis")
        _state["supervisor"] = supervisor
        atexit.register(supervisor.stop)


def pytest_unconfigure(config):
    """Leave the shared Redis as we found it: drop every key under our namespace."""
    url = os.environ.get("REDIS_URL")
    if url and "supervisor" not in _state:
        import redis

        client = redis.Redis.from_url(url)
        try:
            for key in client.scan_iter(match=os.environ["LIFELINE_NAMESPACE"] + ":*", count=500):
                client.delete(key)
        except redis.RedisError:
            pass
    supervisor = _state.pop("supervisor", None)
    if supervisor is not None:
        supervisor.stop()
