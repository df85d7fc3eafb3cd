"""A start is not an emergency (issue 18), end to end: the whole stack as `manage.py demo` starts it, stopped and
started again on the same database, Redis and ports, with requests sent from the first moment the new gateway
listens. None is refused for capacity (a request no node can take yet waits, or gets a 503 that says the fleet is
starting), no incident is opened and no spare promoted; then nodes that served since the start are killed, and
that is a loss at once: an incident, the spare in the place of the first, the level up for the second."""

import os
import signal
import threading
import time
import urllib.error

import pytest

from harness.processes import demo
from tests.conftest import demo_env, stack_database
from tests.helpers import http_json, wait_for

pytestmark = pytest.mark.e2e

CHAT = {"model": "Qwen3-32B", "messages": [{"role": "user", "content": "are you back?"}], "max_tokens": 8}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with stack_database(tmp_path_factory) as database_url:
        var_dir = tmp_path_factory.mktemp("restart-stack")
        options = ["--nodes", "3", "--spares", "1", "--worker-concurrency", "1", "--time-scale", "0.1"]
        options += ["--restart-delay", "-1"]  # a killed node stays dead: the loss is what the test looks at
        stack = demo(var_dir, demo_env(var_dir, database_url, "restart"), *options)
        try:
            yield stack
        finally:
            if stack.proc is not None:
                stack.stop(signum=signal.SIGTERM)


class Senders:
    """Chat requests sent one after another by a few clients, from the first moment the gateway listens."""

    def __init__(self, url: str, key: str, clients: int = 3):
        self.url, self.key = url + "/v1/chat/completions", key
        self.answers: list[tuple[float, int, str]] = []  # (sent at, status, error message)
        self.listening_at: float | None = None
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def start(self):
        for thread in self.threads:
            thread.start()
        return self

    def _run(self):
        while not self.stopping.is_set():
            sent = time.time()
            try:
                status, body = http_json(
                    self.url, data=CHAT, headers={"Authorization": f"Bearer {self.key}"}, timeout=60
                )
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.02)  # not listening yet
                continue
            if self.listening_at is None:
                self.listening_at = sent
            message = body.get("error", {}).get("message", "") if isinstance(body, dict) else ""
            self.answers.append((sent, status, message))

    def stop(self):
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=90)


def diagnosis(stack, restarted: float) -> str:
    """What a failure needs to be understood: every level change (seconds from the restart, cause), each node's
    state, health, breaker and weight, and the control plane's warnings."""
    history = stack.api("/api/degradation")[1]["history"]
    changes = [(round(h["at"] - restarted, 1), h["old"], h["new"], h["cause"]) for h in history]
    nodes = [
        {k: n.get(k) for k in ("name", "state", "health", "breaker", "weight", "spare")}
        for n in stack.api("/api/cluster")[1]["nodes"]
    ]
    warnings = [
        line[:300]
        for name in ("worker.log", "beat.log", "web.log", "gateway.log")
        for line in (stack.var_dir / "log" / name).read_text(errors="replace").splitlines()
        if " WARNING " in line or " ERROR " in line or "breaker" in line or "health" in line
    ]
    return f"level changes: {changes}\nnodes: {nodes}\nwarnings:\n" + "\n".join(warnings[-40:])


def test_a_restart_of_the_whole_stack_is_not_an_emergency(stack):
    stack.start()
    first = stack.info
    status, body = http_json(
        stack.gateway_url + "/v1/chat/completions",
        data=CHAT,
        headers={"Authorization": f"Bearer {first['gateway_key']}"},
        timeout=30,
    )
    assert status == 200, body
    assert stack.stop(signum=signal.SIGTERM) == 0, stack.log()
    # A clean stop lets the Celery worker finish its tasks (warm shutdown): none is lost with its pool process.
    worker_log = (stack.var_dir / "log" / "worker.log").read_text(errors="replace")
    assert "WorkerLostError" not in worker_log and "Traceback" not in worker_log, worker_log[-3000:]

    # The same command again: requests go out from before the gateway listens.
    restarted = time.time()
    senders = Senders(stack.gateway_url, first["gateway_key"]).start()
    stack.start()
    up = time.time()
    wait_for(lambda: len([a for a in senders.answers if a[0] > up]) >= 6, 60, 0.2, "requests after the start")
    senders.stop()

    answers = senders.answers
    assert senders.listening_at is not None and answers
    refused = [a for a in answers if a[1] != 200]
    for sent, status, message in refused:
        assert status == 503 and "the fleet is starting" in message, (sent - restarted, status, message)
    assert len(refused) < len(answers)
    # The first request the gateway took was sent in its first second, and waited for a node rather than fail.
    assert answers[0][0] - senders.listening_at < 1.0

    assert stack.api("/api/incidents")[1]["incidents"] == [], diagnosis(stack, restarted)
    assert stack.node("node-04")["spare"] and stack.node("node-04")["weight"] == 0.0
    degradation = stack.api("/api/degradation")[1]
    assert degradation["level"] == 0, diagnosis(stack, restarted)
    risen = [h for h in degradation["history"] if h["at"] > restarted and h["new"] > 0]
    assert risen == [], diagnosis(stack, restarted)

    # Losses during start-up are losses: node-01 served since the start; killed, an incident and the spare.
    assert time.time() - restarted < 120  # within the start-up grace
    os.kill(stack.node("node-01")["pid"], signal.SIGKILL)
    incident = wait_for(lambda: stack.api("/api/incidents")[1]["incidents"], 20, 0.2, "an incident for node-01")
    assert "node-01" in str(incident[0])
    wait_for(lambda: not stack.node("node-04")["spare"], 20, 0.2, "the spare promoted in node-01's place")
    os.kill(stack.node("node-02")["pid"], signal.SIGKILL)
    level = wait_for(lambda: stack.api("/api/degradation")[1]["level"], 20, 0.2, "the level up for node-02")
    assert level >= 1
