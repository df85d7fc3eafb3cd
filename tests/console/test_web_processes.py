"""Several web processes on one port (`manage.py serve --role web --processes 2`), as real processes on the database
and Redis of the suite: both answer, a node registered through one beats through the other, a SIGKILLed one is
replaced while the other goes on answering, and SIGTERM stops them all."""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
import uuid

import aiohttp
import psutil
import pytest

from console.stack import BASE_DIR, free_port
from harness import debian
from tests.conftest import stack_database
from tests.helpers import wait_for
from tests.recovery.gateway.test_haproxy import haproxy_binary  # noqa: F401 - a fixture

NODE_TOKEN = "web-processes-node-token"
PASSWORD = "correct-horse-web-processes"


def call(url: str, body: dict | None = None, token: str | None = None) -> tuple[int, dict]:
    """One request on a connection of its own (urllib opens one each time): the kernel picks the process."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method="POST" if body is not None else "GET")
    request.add_header("Content-Type", "application/json")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


@pytest.fixture(scope="module")
def web(tmp_path_factory):
    with stack_database(tmp_path_factory) as database_url:
        port = free_port()
        env = {
            **os.environ,
            "DATABASE_URL": database_url,
            "LIFELINE_NAMESPACE": f"{os.environ['LIFELINE_NAMESPACE']}-webpool",
            "LIFELINE_NODE_TOKEN": NODE_TOKEN,
            "LIFELINE_VAR_DIR": str(tmp_path_factory.mktemp("webpool")),
            "PYTHONUNBUFFERED": "1",
        }
        argv = [sys.executable, "manage.py", "serve", "--role", "web", "--host", "127.0.0.1", "--port", str(port)]
        log = open(tmp_path_factory.mktemp("webpool-log") / "web.log", "w+")
        proc = subprocess.Popen(argv + ["--processes", "2"], cwd=BASE_DIR, env=env, stdout=log, stderr=log)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_for(lambda: _answers(url), timeout_s=120, message="the web processes to answer /healthz")
            user = [sys.executable, "manage.py", "create_user", "op", "--role", "operator", "--password", PASSWORD]
            subprocess.run(user, cwd=BASE_DIR, env=env, check=True, capture_output=True)
            yield proc, url, log
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
            log.close()


def _answers(url: str) -> bool:
    try:
        return call(url + "/healthz")[0] == 200
    except OSError:
        return False


def registration(name: str, session: str) -> dict:
    return {
        "name": name,
        "session": session,
        "address": "http://127.0.0.1:9",
        "rack": "rack-a",
        "model": "Qwen3-32B",
        "gpu": "H100-SXM",
        "tp": 1,
        "pid": 4242,
        "host": "h",
        "gpus": [{"index": 0, "uuid": f"GPU-{name}", "name": "H100", "memory_bytes": 80 * 10**9}],
    }


async def log_in(session: aiohttp.ClientSession, url: str) -> None:
    async with session.get(url + "/login/") as page:
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', await page.text()).group(1)
    form = {"username": "op", "password": PASSWORD, "csrfmiddlewaretoken": token}
    async with session.post(url + "/login/", data=form, allow_redirects=False) as response:
        assert response.status == 302, await response.text()


def pids_answering(url: str, requests: int = 40) -> set[int]:
    return {call(url + "/healthz")[1]["process"] for _ in range(requests)}


def children(proc: subprocess.Popen) -> set[int]:
    return {c.pid for c in psutil.Process(proc.pid).children() if c.status() != psutil.STATUS_ZOMBIE}


def test_two_processes_answer_on_one_port_and_a_node_beats_through_either(web):
    proc, url, _log = web
    wait_for(lambda: len(children(proc)) == 2, timeout_s=30, message="two web processes")
    assert wait_for(lambda: pids_answering(url) == children(proc), timeout_s=30, message="both processes answering")

    name, session = f"wp-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
    status, body = call(url + "/api/nodes/register", registration(name, session), NODE_TOKEN)
    assert status == 200 and body["state"] == "join", body
    states = []
    for _ in range(20):  # each beat on a connection of its own: both processes take some
        beat = {"session": session, "model_state": "serving", "load": {"running": 1, "waiting": 0}}
        status, body = call(url + f"/api/nodes/{name}/heartbeat", beat, NODE_TOKEN)
        assert status == 200, body
        states.append(body["state"])
    assert states[-1] == "serving" and set(states) <= {"join", "serving"}


async def test_live_pages_on_either_process_get_the_events_of_the_other(web):
    """Cluster pages' WebSockets on both processes (told apart by their connections) all see the tile of a node
    registered through one of them: the channel layer in Redis carries the event."""
    proc, url, _log = web
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:
        await log_in(session, url)
        sockets, holder = [], {}
        try:
            # The processes share one listening socket and whichever is waiting takes the next connection, so one
            # can take a burst of them all: pages are opened, eight at a time, until both processes hold some.
            while len(set(holder.values())) < 2 and len(sockets) < 64:
                for _ in range(8):
                    ws = await session.ws_connect(
                        url.replace("http", "ws") + "/ws/cluster/", origin=url, heartbeat=None
                    )
                    assert (await ws.receive_json(timeout=10))["kind"] == "hello"
                    sockets.append(ws)
                    await asyncio.sleep(0.01)
                ports = {ws.get_extra_info("sockname")[1]: ws for ws in sockets}
                holder = {}
                for pid in children(proc):
                    for conn in psutil.Process(pid).net_connections("tcp"):
                        if conn.raddr and conn.raddr.port in ports:
                            holder[conn.raddr.port] = pid
            assert set(holder) == set(ports) and len(set(holder.values())) == 2, holder  # both processes hold some

            name = f"wp-live-{uuid.uuid4().hex[:6]}"
            status, _ = await asyncio.to_thread(
                call, url + "/api/nodes/register", registration(name, uuid.uuid4().hex), NODE_TOKEN
            )
            assert status == 200

            async def sees_the_node(ws) -> bool:
                while True:
                    frame = await ws.receive_json(timeout=15)
                    if frame.get("kind") != "loads" and name in json.dumps(frame):
                        return True

            assert await asyncio.gather(*(sees_the_node(ws) for ws in sockets)) == [True] * len(sockets)
        finally:
            for ws in sockets:
                await ws.close()


async def test_the_shipped_haproxy_web_configuration_balances_pages_and_websockets(web, tmp_path, haproxy_binary):  # noqa: F811
    """docker/haproxy-web.cfg as shipped, its addresses pointed here: one web host (the two processes) and one that
    is down. Requests and a live page's WebSocket go through; the dead host is skipped (`option redispatch`)."""
    _proc, url, _log = web
    port, dead = free_port(), free_port()
    text = (BASE_DIR / "docker" / "haproxy-web.cfg").read_text()
    text, binds = re.subn(r"bind \*:8010", f"bind 127.0.0.1:{port}", text)
    text, servers = re.subn(r"server web-a web:8000", f"server web-a {url.removeprefix('http://')}", text)
    text, others = re.subn(r"server web-b web-b:8000", f"server web-b 127.0.0.1:{dead}", text)
    assert (binds, servers, others) == (1, 1, 1), "docker/haproxy-web.cfg no longer has its bind and two servers"
    config = tmp_path / "haproxy-web.cfg"
    config.write_text(text)
    env = debian.env(haproxy_binary)
    check = subprocess.run([str(haproxy_binary), "-c", "-f", str(config)], env=env, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    haproxy = subprocess.Popen([str(haproxy_binary), "-db", "-f", str(config)], env=env, stderr=subprocess.DEVNULL)
    front = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _answers(front), timeout_s=30, message="HAProxy to forward /healthz")
        assert [call(front + "/healthz")[0] for _ in range(10)] == [200] * 10  # the dead host never answers one
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:
            await log_in(session, front)
            async with session.ws_connect(front.replace("http", "ws") + "/ws/cluster/", origin=front) as ws:
                assert (await ws.receive_json(timeout=10))["kind"] == "hello"
    finally:
        haproxy.terminate()
        haproxy.wait(10)


def test_a_killed_process_is_replaced_while_the_other_answers_and_sigterm_stops_all(web):
    proc, url, log = web
    wait_for(lambda: len(children(proc)) == 2, timeout_s=30, message="two web processes")
    before = children(proc)
    victim = min(before)
    os.kill(victim, signal.SIGKILL)
    answered = [call(url + "/healthz")[0] for _ in range(30)]  # while the victim is being replaced
    assert answered == [200] * 30
    wait_for(lambda: len(children(proc) - {victim}) == 2, timeout_s=60, message="a process started in its place")
    after = children(proc)
    assert victim not in after and len(after - before) == 1
    assert wait_for(lambda: pids_answering(url) == after, timeout_s=30, message="the new process answering")
    log.seek(0)
    assert f"web process {victim} exited" in log.read()

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert not any(psutil.pid_exists(pid) for pid in after)
    with pytest.raises(OSError):
        call(url + "/healthz")
