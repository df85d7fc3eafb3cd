"""The supervisor's process handling: ports for servers that a client socket cannot take first, and a clean stop
that lets a Celery worker finish the tasks its pool holds."""

import socket
import sys
import time

from console.stack import Child, Supervisor, _ephemeral_range, free_port, port_in_use

# The leader forks a pool process that runs a one-second "task"; on SIGTERM the leader waits for its pool to finish,
# as a Celery worker's warm shutdown does. A pool process that is itself sent SIGTERM loses its task.
LEADER = """
import signal, subprocess, sys, time
pool = subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[1]])
def stop(*_):
    pool.wait()
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
while True:
    time.sleep(0.05)
"""
POOL = """
import signal, sys, time
def lost(*_):
    open(sys.argv[1], "a").write("lost\\n")
    sys.exit(1)
signal.signal(signal.SIGTERM, lost)
open(sys.argv[1], "a").write("started\\n")
time.sleep(1.0)
open(sys.argv[1], "a").write("done\\n")
"""


def run_and_stop(tmp_path, term_leader_only):
    events = tmp_path / f"events-{term_leader_only}"
    supervisor = Supervisor(tmp_path / "log")
    supervisor.spawn(
        Child("worker", [sys.executable, "-c", LEADER, str(events), POOL], {}, term_leader_only=term_leader_only)
    )
    deadline = time.monotonic() + 20
    while not events.exists() or "started" not in events.read_text():
        assert time.monotonic() < deadline, "the pool did not start"
        time.sleep(0.02)
    supervisor.stop(timeout_s=10)
    return events.read_text().split()


def test_a_worker_stopped_alone_lets_its_pool_finish_the_task_it_holds(tmp_path):
    assert run_and_stop(tmp_path, term_leader_only=True) == ["started", "done"]


def test_a_group_stopped_whole_loses_the_task_the_pool_held(tmp_path):
    # The behaviour the worker's flag exists to avoid (the demo's worker.log had WorkerLostError at every stop).
    assert run_and_stop(tmp_path, term_leader_only=False) == ["started", "lost"]


def test_free_ports_are_consecutive_free_and_outside_the_range_outgoing_connections_take_from():
    low, high = _ephemeral_range()
    for _ in range(20):
        first = free_port(count=2)
        assert not port_in_use("127.0.0.1", first) and not port_in_use("127.0.0.1", first + 1)
        if low > 11_000:
            assert first + 1 < low, (first, low)
    # An outgoing connection's local port comes from the ephemeral range, so it never holds a port chosen here.
    with socket.create_server(("127.0.0.1", 0)) as server:
        with socket.create_connection(server.getsockname()) as client:
            assert low <= client.getsockname()[1] <= high


# A child that touches its sign-of-life file while it works, then gets stuck: it stops touching it and ignores
# SIGTERM, as celery beat did after a Redis restart in the chaos soak.
STUCK = """
import pathlib, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
alive = pathlib.Path(sys.argv[1])
for _ in range(5):
    alive.touch()
    time.sleep(0.1)
time.sleep(600)
"""


def test_a_child_that_stops_giving_signs_of_life_is_killed_and_started_again(tmp_path, caplog):
    alive = tmp_path / "beat.alive"
    supervisor = Supervisor(tmp_path / "log")
    child = supervisor.spawn(
        Child(
            "beat",
            [sys.executable, "-c", STUCK, str(alive)],
            {},
            restart_delay_s=0,
            alive_file=alive,
            alive_within_s=1.5,
        )
    )
    first = child.pid
    try:
        for _ in range(10):  # while it touches the file, and for a while after: not yet stale
            assert supervisor.poll() == []
            time.sleep(0.1)
        deadline = time.monotonic() + 10
        while child.pid == first:
            assert time.monotonic() < deadline, "the stuck child was not replaced"
            supervisor.poll()
            time.sleep(0.1)
        assert child.restarts == 1 and child.history == [first, child.pid]
        assert any(f"beat (pid {first}) gave no sign of life" in r.getMessage() for r in caplog.records)
    finally:
        supervisor.stop(timeout_s=1)


def test_a_child_without_a_sign_of_life_file_is_never_taken_as_stuck(tmp_path):
    supervisor = Supervisor(tmp_path / "log")
    child = supervisor.spawn(Child("quiet", [sys.executable, "-c", "import time; time.sleep(600)"], {}))
    try:
        child.started_wall -= 3600  # an hour of silence
        assert supervisor.poll() == [] and child.alive
    finally:
        supervisor.stop(timeout_s=1)
