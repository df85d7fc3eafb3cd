"""docker/haproxy.cfg, the reference load balancer in front of several gateways (issue 16), run for real: HAProxy
from Debian's package (harness/debian.py) with the file as shipped, only its listen and server addresses pointed at
this machine. A gateway is SIGKILLed under streams that came in through HAProxy: the reference resuming client,
which knows only HAProxy's address, finishes every stream with text identical to an undisturbed run (HAProxy sends
each reconnection, with Last-Event-ID, to the gateway that lives), and plain requests sent while HAProxy has not
yet marked the dead gateway down are retried on the other (`retry-on conn-failure`, `option redispatch`)."""

import asyncio
import re
import subprocess

import aiohttp
import pytest

from clients.resuming import Resumes
from harness import debian
from tests.gateway_cluster import KEY
from tests.helpers import BASE_DIR, http_json, wait_for
from tests.recovery.gateway.test_gateway_takeover import (
    body,
    collect,
    finish_reason,
    gateway_process,
    kill_when_under_way,
    text_of,
    watching_all,
)

CONFIG = BASE_DIR / "docker" / "haproxy.cfg"


def haproxy_config(listen_port: int, gateways: list[str]) -> str:
    """docker/haproxy.cfg with its addresses replaced by this machine's; every other line as shipped."""
    text = CONFIG.read_text()
    text, binds = re.subn(r"bind \*:\d+", f"bind 127.0.0.1:{listen_port}", text)
    servers = iter(g.removeprefix("http://") for g in gateways)
    text, count = re.subn(r"(server \S+ )\S+:8100", lambda m: m.group(1) + next(servers), text)
    assert (binds, count) == (1, len(gateways)), "docker/haproxy.cfg no longer has one bind and a server per gateway"
    return text


def forwarding(front: str) -> bool:
    """Both gateways marked up by HAProxy's checks: fresh connections reach each of them."""
    seen = set()
    for _ in range(8):
        try:
            status, health = http_json(front + "/healthz", timeout=1)
        except (OSError, ValueError):  # not listening yet, or its own 503 page: no server is up yet
            return False
        if status == 200 and len(health["watching"]) == 3:
            seen.add(health["gateway"])
    return len(seen) == 2


@pytest.fixture
def haproxy_binary():
    return debian.tool(
        "haproxy",
        ["haproxy", "liblua5.3-0", "libopentracing-c-wrapper0", "libopentracing1"],
        "usr/sbin/haproxy",
    )


def test_the_shipped_configuration_is_valid(haproxy_binary, tmp_path):
    config = tmp_path / "haproxy.cfg"
    config.write_text(haproxy_config(18110, ["http://127.0.0.1:18100", "http://127.0.0.1:18101"]))
    check = subprocess.run(
        [str(haproxy_binary), "-c", "-f", str(config)], env=debian.env(haproxy_binary), capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr


async def test_streams_through_haproxy_survive_a_gateways_sigkill(cluster, tmp_path, haproxy_binary):
    from console.stack import free_port

    cluster.start_nodes("hp-a", "hp-b", "hp-c")
    doomed, doomed_url = gateway_process(cluster, "gw-hp-doomed", tmp_path)
    survivor, survivor_url = gateway_process(cluster, "gw-hp-survivor", tmp_path)
    port = free_port()
    config = tmp_path / "haproxy.cfg"
    config.write_text(haproxy_config(port, [doomed_url, survivor_url]))
    balancer = subprocess.Popen(
        [str(haproxy_binary), "-db", "-f", str(config)],
        env=debian.env(haproxy_binary),
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "haproxy.log", "w"),
    )
    front = f"http://127.0.0.1:{port}"
    try:
        for url in (doomed_url, survivor_url):
            await asyncio.to_thread(wait_for, lambda u=url: watching_all(u, 3), 30, 0.1, f"{url} up")
        await asyncio.to_thread(wait_for, lambda: forwarding(front), 30, 0.1, "HAProxy forwarding to both gateways")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            reference = await asyncio.gather(*(collect(session, [survivor_url], body(i)) for i in range(16)))
            resumes, seen = [Resumes() for _ in range(16)], [0] * 16
            runs = [
                asyncio.create_task(collect(session, [front], body(i), resumes[i], seen=seen, index=i))
                for i in range(16)
            ]
            at_kill = await kill_when_under_way(seen, doomed)
            # At once, before HAProxy's checks mark it down (inter 1s, fall 2): plain requests, each on a new
            # connection, half of which HAProxy first tries on the dead gateway.
            plain = [
                await asyncio.to_thread(
                    http_json,
                    front + "/v1/chat/completions",
                    data={**body(i, 4), "stream": False},
                    headers={"Authorization": f"Bearer {KEY}"},
                    timeout=30,
                )
                for i in range(8)
            ]
            answers = await asyncio.gather(*runs)
    finally:
        for proc in (doomed, survivor, balancer):
            if proc.poll() is None:
                proc.kill()
    assert [status for status, _ in plain] == [200] * 8, plain
    assert [text_of(a) for a in answers] == [text_of(r) for r in reference]
    assert [finish_reason(r) for r in reference] == ["length"] * 16
    assert max(at_kill) < 120, at_kill  # none had ended when the gateway died
    # leastconn spread the streams over both gateways: the dead one's were taken over mid-way, once each, from a
    # token they had; none started over, and the survivor's were never cut.
    taken_over = [r for r in resumes if r.count]
    assert 0 < len(taken_over) < 16, [(r.count, r.from_ids) for r in resumes]
    assert all(r.count <= 1 and r.restarts == 0 for r in resumes), [(r.count, r.restarts) for r in resumes]
    assert all(0 < int(r.from_ids[0].rsplit(".", 1)[1]) < 120 for r in taken_over)
