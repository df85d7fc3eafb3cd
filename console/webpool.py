"""Several web processes on one port: `manage.py serve --role web --processes N`.

One listening socket, opened here and inherited by N daphne processes (`daphne --fd`), as gunicorn's workers share
theirs: each new connection goes to whichever process accepts it first, so a process that dies takes only the
connections it held, and the others go on accepting while it is started again. Everything a web process keeps is in
the database and Redis (sessions, the log-in counters' cache, the channel layer that carries live pages' events), so
any of them answers any request, and a live page's WebSocket gets the events of every process. One web process keeps
about 256 nodes beating every second (docs/several-machines.md); a larger fleet needs more of them, or more hosts
behind a balancer.

This process only supervises: a child that exits is started again (after a pause that grows while children keep
dying young, so a web process that cannot start does not spin); SIGTERM or SIGINT is passed on to every child, and
this process exits when they have.
"""

import ipaddress
import logging
import signal
import socket
import subprocess
import time
from collections.abc import Callable

log = logging.getLogger("lifeline.web")

YOUNG_S = 5.0  # a child that dies sooner than this after its start counts towards the restart pause
MAX_PAUSE_S = 30.0
STOP_WAIT_S = 15.0


def listen(host: str, port: int) -> socket.socket:
    """The one listening socket every web process accepts on (IPv4: daphne adopts an inherited socket as AF_INET)."""
    try:
        if ipaddress.ip_address(host).version != 4:
            raise ValueError
    except ValueError:
        raise ValueError(
            f"--processes above 1 listens on an IPv4 address, not {host!r}: give --host 0.0.0.0 or one of the "
            "host's IPv4 addresses"
        ) from None
    sock = socket.create_server((host, port), backlog=2048)
    sock.set_inheritable(True)
    return sock


def supervise(argv_for: Callable[[int], list[str]], processes: int, sock: socket.socket) -> int:
    """Keep `processes` children of `argv_for(fd)` running on `sock` until told to stop; their exit status."""
    fd = sock.fileno()
    argv = argv_for(fd)
    children: dict[int, subprocess.Popen] = {}
    started: dict[int, float] = {}
    stopping: list[int] = []
    pause, next_start = 0.0, 0.0

    def start() -> None:
        child = subprocess.Popen(argv, pass_fds=(fd,))
        children[child.pid], started[child.pid] = child, time.monotonic()
        log.info("web process %d started (%d of %d)", child.pid, len(children), processes)

    def stop(signum: int, _frame) -> None:
        stopping.append(signum)
        for child in children.values():
            if child.poll() is None:
                child.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for _ in range(processes):
        start()
    while not stopping:
        time.sleep(0.2)
        for pid, child in list(children.items()):
            if child.poll() is None:
                continue
            lived = time.monotonic() - started.pop(pid)
            del children[pid]
            pause = min(MAX_PAUSE_S, max(1.0, pause * 2)) if lived < YOUNG_S else 0.0
            next_start = time.monotonic() + pause
            log.warning(
                "web process %d exited (status %s) after %.1f s; starting another in %.0f s",
                pid,
                child.returncode,
                lived,
                pause,
            )
        while not stopping and len(children) < processes and time.monotonic() >= next_start:
            start()
    deadline = time.monotonic() + STOP_WAIT_S
    for child in children.values():
        try:
            child.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("web process %d did not stop within %.0f s: killed", child.pid, STOP_WAIT_S)
            child.kill()
            child.wait()
    sock.close()
    return 0
