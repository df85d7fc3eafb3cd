"""A clean stop is not the fleet's loss: `manage.py demo` stops the control plane's periodic work (beat and the
worker) before the nodes deregister, so no capacity check sees the nodes leave and raises the level (an incident
on every restart), and keeps the web process and Redis up until the nodes are gone, as deregistering needs them."""

import sys
import time

from console.management.commands.demo import stop_phases
from console.stack import Child, Supervisor

# Each child writes when it got SIGTERM, and stays a moment before it exits, as a node deregistering does.
CHILD = """
import signal, sys, time
def stop(*_):
    open(sys.argv[1], "a").write(f"{sys.argv[2]} term {time.monotonic()}\\n")
    time.sleep(0.3)
    open(sys.argv[1], "a").write(f"{sys.argv[2]} exit {time.monotonic()}\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
open(sys.argv[1], "a").write(f"{sys.argv[2]} up\\n")
while True:
    time.sleep(0.05)
"""


def test_the_demo_stops_beat_and_the_worker_before_the_nodes_and_web_and_redis_after_them(tmp_path):
    events = tmp_path / "events"
    supervisor = Supervisor(tmp_path / "log")
    names = ["redis", "web", "worker", "beat", "gateway", "gateway-2", "node-01", "node-02"]  # the demo's start order
    for name in names:
        supervisor.spawn(Child(name, [sys.executable, "-c", CHILD, str(events), name], {}))
    deadline = time.monotonic() + 20
    while not events.exists() or events.read_text().count(" up") < len(names):
        assert time.monotonic() < deadline, "the children did not start"
        time.sleep(0.05)

    supervisor.stop(order=stop_phases(names))

    at = {}
    for line in events.read_text().splitlines():
        name, what, *when = line.split()
        if when:
            at[name, what] = float(when[0])
    for control in ("beat", "worker"):
        for node in ("node-01", "node-02"):
            assert at[control, "exit"] < at[node, "term"], (control, node)
    for server in ("web", "redis"):
        for node in ("node-01", "node-02"):
            assert at[server, "term"] > at[node, "exit"], (server, node)
