"""The whole system for the operations benchmarks: `manage.py demo` on its embedded default
(its own PostgreSQL and Redis), with its Celery worker and beat, driven through the console's JSON API."""

import os
import secrets
import signal
import tempfile
from pathlib import Path

from benchmarks.common import issue_token
from harness.processes import demo, http_json, wait_for  # noqa: F401 - wait_for is the benchmarks' too


class OpsStack:
    def __init__(
        self, nodes: int, spares: int = 0, time_scale: float = 1.0, worker_concurrency: int = 2, extra: tuple = ()
    ):
        self.var_dir = Path(tempfile.mkdtemp(prefix="bench-ops-"))
        env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}
        env.update(
            {
                "LIFELINE_VAR_DIR": str(self.var_dir),
                "LIFELINE_NAMESPACE": f"bench-{secrets.token_hex(3)}",
                "PYTHONUNBUFFERED": "1",
                "LIFELINE_LOG_LEVEL": "WARNING",
            }
        )
        self.env = env
        options = ["--nodes", str(nodes), "--spares", str(spares), "--restart-delay", "-1"]
        options += ["--worker-concurrency", str(worker_concurrency), "--time-scale", str(time_scale), *extra]
        self.stack = demo(self.var_dir, env, *options)

    def start(self, timeout_s: float = 600) -> "OpsStack":
        self.stack.start(timeout_s)
        self.info = self.stack.info
        self.console = self.info["urls"]["console"].rstrip("/")
        self.gateway = self.info["urls"]["gateway"]
        return self

    def api(self, method: str, path: str, body=None, token: str | None = None):
        status, answer = http_json(
            self.console + path,
            data=body,
            method=method,
            headers={"Authorization": f"Bearer {token or self.info['api_token']}"},
            timeout=30,
        )
        return status, answer

    def token_for(self, username: str) -> str:
        """An API token acting as `username` (the demo's users are named after their roles)."""
        return issue_token(username, self.env)

    def gateway_health(self) -> dict:
        return http_json(self.gateway.removesuffix("/v1") + "/healthz")[1]

    def node(self, name: str) -> dict:
        return self.stack.node(name)

    def stop(self) -> None:
        self.stack.stop(timeout_s=60, signum=signal.SIGTERM)
