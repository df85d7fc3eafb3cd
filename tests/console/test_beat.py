"""celery beat, a real process, against the database's outages (console/beat.py). Started while its database refuses
connections, it waits for the database, alive and saying why, and starts its schedule once the database is back
(before, its scheduler's first read raised, beat exited with a traceback, and its supervisor restarted it: the chaos
soak's database restart). Sent SIGTERM while a tick's query waits on the database, it ends at once, the query
abandoned (before, Celery's handler saved the schedule on top of that query and waited for its connection forever:
the chaos soak's beat restart left the control plane without a beat for 30 s)."""

import os
import signal
import subprocess
import sys
from urllib.parse import urlsplit

import psycopg
from psycopg import sql

from harness import databases
from tests.conftest import template_database
from tests.helpers import wait_for


def allow_connections(url: str, name: str, allowed: bool) -> None:
    with psycopg.connect(databases.with_name(url, "postgres"), autocommit=True) as admin:
        admin.execute(
            sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS {}").format(
                sql.Identifier(name), sql.SQL("true" if allowed else "false")
            )
        )


def scheduled(url: str) -> int:
    with psycopg.connect(url) as db:
        return db.execute("SELECT count(*) FROM django_celery_beat_periodictask WHERE name = 'react'").fetchone()[0]


def start_beat(url: str, tmp_path) -> tuple[subprocess.Popen, object, object]:
    alive, log = tmp_path / "beat.alive", tmp_path / "beat.log"
    env = {
        **os.environ,
        "DATABASE_URL": url,
        "LIFELINE_BEAT_ALIVE_FILE": str(alive),
        "LIFELINE_NAMESPACE": os.environ["LIFELINE_NAMESPACE"] + "-beat",  # its sends stay in the run's keys
    }
    argv = [sys.executable, "-m", "celery", "-A", "console", "beat", "-l", "INFO", "--pidfile="]
    with open(log, "w") as out:
        beat = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return beat, alive, log


def stop(beat: subprocess.Popen) -> None:
    if beat.poll() is None:
        os.killpg(beat.pid, signal.SIGKILL)
    beat.wait()


def test_beat_started_while_its_database_refuses_waits_and_then_schedules(tmp_path):
    server = databases.server_url()
    with databases.scratch("lifeline_beat", template_database()) as url:
        name = urlsplit(url).path.lstrip("/")
        assert scheduled(url) == 0  # the migrated template has no schedule: beat writes it at its start
        allow_connections(server, name, False)
        beat, alive, log = start_beat(url, tmp_path)
        try:
            wait_for(lambda: "beat waits for its database" in log.read_text(), 60, 0.2, "beat waiting, saying why")
            assert "not currently accepting connections" in log.read_text()
            touched = wait_for(lambda: alive.exists() and alive.stat().st_mtime, 10, 0.2, "its sign of life")
            wait_for(lambda: alive.stat().st_mtime > touched, 10, 0.2, "its sign of life while it waits")
            assert beat.poll() is None, log.read_text()[-3000:]

            allow_connections(server, name, True)
            wait_for(lambda: scheduled(url) == 1, 30, 0.2, "beat's schedule written once the database is back")
            text = log.read_text()
            assert "beat's database is back after" in text
            assert "Traceback" not in text and "CRITICAL" not in text, text[-3000:]
            assert beat.poll() is None, text[-3000:]
        finally:
            allow_connections(server, name, True)  # the scratch database is dropped with FORCE either way
            stop(beat)


def test_beat_sent_sigterm_while_a_tick_s_query_waits_ends_at_once(tmp_path):
    with databases.scratch("lifeline_beat", template_database()) as url:
        name = urlsplit(url).path.lstrip("/")
        beat, alive, log = start_beat(url, tmp_path)
        try:
            wait_for(lambda: scheduled(url) == 1, 60, 0.2, "beat's schedule written")
            with psycopg.connect(url) as holder:
                # Every tick reads the schedule's last change: with its table locked, the tick's query waits.
                holder.execute("LOCK TABLE django_celery_beat_periodictasks IN ACCESS EXCLUSIVE MODE")
                waiting = (
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND wait_event_type = 'Lock' "
                    "AND pid <> pg_backend_pid()"
                )
                with psycopg.connect(url) as watcher:
                    wait_for(
                        lambda: watcher.execute(waiting, (name,)).fetchone()[0] >= 1, 20, 0.1, "a tick's query waiting"
                    )
                os.killpg(beat.pid, signal.SIGTERM)
                # The loop unwinds out of the waiting query (its connection dropped), saves the schedule on a new
                # one, and beat exits, the lock still held.
                try:
                    beat.wait(15)
                except subprocess.TimeoutExpired:
                    raise AssertionError(f"beat still running 15 s after SIGTERM:\n{log.read_text()[-3000:]}") from None
            assert beat.returncode == 0, log.read_text()[-3000:]
        finally:
            stop(beat)
