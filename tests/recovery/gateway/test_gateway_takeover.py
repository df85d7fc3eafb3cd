"""Streams survive the death of their gateway (issue 16): every token event has an id, `<request id>.<tokens so far>`;
a client that reconnects to any gateway with Last-Event-ID gets the rest of its stream from the node that holds the
request, nothing lost or repeated. A gateway is SIGKILLed under 24 streams; the reference resuming client
(clients/resuming.py) finishes every one through the other gateway with text identical to an undisturbed run."""

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys

import aiohttp
import pytest

from clients.resuming import Resumes, stream
from recovery.gateway.app import COORDINATOR_KEY
from tests import gateway_cluster
from tests.gateway_cluster import AGENT, KEY
from tests.helpers import BASE_DIR, http_json, wait_for

MODEL = "Qwen3-32B"
OTHER_TENANT_KEY = "llk_test-key-of-another-tenant"


def body(index: int, max_tokens: int = 120) -> dict:
    words = "the operator drains node seven in rack b and watches the queue".split()
    prompt = " ".join(words[(index + i) % len(words)] for i in range(40))
    request = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"{index} {prompt}"}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    # Every stream runs to max_tokens (the emulated model may pick its end-of-text token early otherwise).
    request["min_tokens"] = max_tokens
    return request


def text_of(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))


def finish_reason(chunks: list[dict]) -> str | None:
    return next((c["choices"][0]["finish_reason"] for c in reversed(chunks) if c.get("choices")), None)


async def collect(session, gateways, request_body, resumes=None, key=KEY, seen=None, index=0) -> list[dict]:
    """The stream's chunks; with `seen`, seen[index] counts them as they are read (kill_when_under_way)."""
    chunks = []
    async for chunk in stream(session, gateways, key, request_body, resumes=resumes):
        chunks.append(chunk)
        if seen is not None:
            seen[index] += 1
    return chunks


def gateway_process(cluster, name: str, tmp_path) -> tuple[subprocess.Popen, str]:
    return gateway_cluster.gateway_process(cluster.keys.namespace, name, tmp_path)


UNDER_WAY = 3  # chunks every stream has read before its gateway is killed


async def kill_when_under_way(seen: list[int], gateway: subprocess.Popen) -> list[int]:
    """SIGKILL `gateway` as soon as every stream has read its first UNDER_WAY chunks (`seen`, counted by collect
    here, on the client's side); what each had read then. (The nodes' running count, polled over HTTP, once read
    "all running" so late on a loaded host that every stream had ended before the kill: nothing to take over.)"""

    async def under_way():
        while min(seen) < UNDER_WAY:
            await asyncio.sleep(0.005)

    try:
        await asyncio.wait_for(under_way(), 30)
    except TimeoutError:
        raise AssertionError(f"not every stream under way in 30 s (chunks read: {seen})") from None
    at_kill = list(seen)
    gateway.send_signal(signal.SIGKILL)
    await asyncio.to_thread(gateway.wait)
    return at_kill


def watching_all(base: str, count: int) -> bool:
    try:
        return len(http_json(base + "/healthz", timeout=1)[1]["watching"]) == count
    except OSError:
        return False


# Long enough that none can finish between "every stream running" and the SIGKILL landing, on a machine busy with
# other tests (at 120 tokens, a run beside two other test workers saw all 24 finish first, and nothing to take over).
TAKEOVER_TOKENS = 480


async def test_a_sigkilled_gateways_streams_finish_through_the_other_with_identical_text(cluster, tmp_path):
    cluster.start_nodes("tk-a", "tk-b", "tk-c")
    first, first_url = gateway_process(cluster, "gw-doomed", tmp_path)
    second, second_url = gateway_process(cluster, "gw-survivor", tmp_path)
    try:
        for url in (first_url, second_url):
            await asyncio.to_thread(wait_for, lambda u=url: watching_all(u, 3), 30, 0.1, f"{url} up")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            reference = await asyncio.gather(
                *(collect(session, [second_url], body(i, TAKEOVER_TOKENS)) for i in range(24))
            )
            resumes, seen = [Resumes() for _ in range(24)], [0] * 24
            runs = [
                asyncio.create_task(
                    collect(session, [first_url, second_url], body(i, TAKEOVER_TOKENS), resumes[i], seen=seen, index=i)
                )
                for i in range(24)
            ]
            # Every stream under way through the first gateway: then it dies, as a SIGKILL leaves it.
            at_kill = await kill_when_under_way(seen, first)
            answers = await asyncio.gather(*runs)
    finally:
        for proc in (first, second):
            if proc.poll() is None:
                proc.kill()
    assert [text_of(a) for a in answers] == [text_of(r) for r in reference]
    assert all(text_of(r) for r in reference)
    # Every stream was cut mid-way and taken over once, from a token it already had: none started over.
    assert [finish_reason(r) for r in reference] == ["length"] * 24
    assert max(at_kill) < TAKEOVER_TOKENS, at_kill  # none had ended when its gateway died
    assert [(r.count, r.restarts) for r in resumes] == [(1, 0)] * 24, [(r.from_ids, r.restarts) for r in resumes]
    assert all(0 < int(r.from_ids[0].rsplit(".", 1)[1]) < TAKEOVER_TOKENS for r in resumes)


async def test_a_streams_first_token_reaches_its_client_only_once_its_record_is_written(cluster, monkeypatch):
    """A client that has a token can resume through another gateway. The record that lets it was queued with the
    first token and written a batch later: on a loaded host (the suite beside other work) a gateway SIGKILLed in
    between left clients with tokens and a 404 for their resume. Here Redis answers the gateway's writes 0.4 s late."""
    cluster.start_nodes("tk-r")
    base = await cluster.gateway("gw-record")
    signals = cluster.servers[-1].app[COORDINATOR_KEY].signals
    pipeline = signals.redis.pipeline

    def slow_pipeline(*args, **kwargs):
        pipe = pipeline(*args, **kwargs)
        execute = pipe.execute

        async def late(*a, **k):
            await asyncio.sleep(0.4)
            return await execute(*a, **k)

        pipe.execute = late
        return pipe

    monkeypatch.setattr(signals.redis, "pipeline", slow_pipeline)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.post(
            base + "/v1/chat/completions", json={**body(2), "stream": True}, headers={"Authorization": f"Bearer {KEY}"}
        ) as response:
            async for line in response.content:
                if line.startswith(b"id: "):
                    request_id = line[4:].decode().strip().rsplit(".", 1)[0]
                    assert cluster.client.get(cluster.keys.stream(request_id)) is not None  # there, with the token
                    break
            else:
                raise AssertionError("the stream sent no token")


async def test_a_client_that_comes_back_within_the_hold_gets_the_rest_and_after_it_a_410(cluster):
    cluster.start_nodes("tk-d", extra=("--park-grace", "1.5"))
    base = await cluster.gateway("gw-hold")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        reference = text_of(await collect(session, [base], body(1)))
        for wait_s, expect in ((0.2, "rest"), (2.5, 410)):
            request = {**body(1), "stream": True}
            last_id, got = None, []
            async with session.post(
                base + "/v1/chat/completions", json=request, headers={"Authorization": f"Bearer {KEY}"}
            ) as response:
                async for line in response.content:  # read 10 tokens, then go away
                    if line.startswith(b"id: "):
                        last_id = line[4:].strip().decode()
                    elif line.startswith(b"data: {"):
                        got.append(json.loads(line[6:]))
                        if len(got) == 10:
                            break
            await asyncio.sleep(wait_s)
            headers = {"Authorization": f"Bearer {KEY}", "Last-Event-ID": last_id}
            async with session.post(base + "/v1/chat/completions", json=request, headers=headers) as response:
                if expect == 410:
                    answer = await response.json()
                    assert response.status == 410 and answer["error"]["code"] == "stream_not_resumable", answer
                    assert "not held on this node" in answer["error"]["message"]
                    continue
                assert response.status == 200
                raw = (await response.read()).decode()
            rest = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
            assert ": lifeline resumed this stream on tk-d at token 10" in raw
            assert text_of(got + rest) == reference


async def test_resuming_someone_elses_stream_a_finished_one_or_a_malformed_id_is_refused(cluster):
    cluster.start_nodes("tk-e")
    cluster.client.hset(
        cluster.keys.gateway_keys,
        hashlib.sha256(OTHER_TENANT_KEY.encode()).hexdigest(),
        json.dumps({"id": 2, "tenant": "globex", "tier": "premium"}),
    )
    base = await cluster.gateway("gw-refusals")
    url = base + "/v1/chat/completions"

    async def post(headers, request=None, key=KEY):
        async with aiohttp.ClientSession() as session:
            async with session.post(
                url, json=request or {**body(2), "stream": True}, headers={"Authorization": f"Bearer {key}", **headers}
            ) as response:
                raw = await response.read()
                return response.status, raw

    # A running stream of acme's, its id taken from its first event.
    async with aiohttp.ClientSession() as session:
        async with session.post(
            url, json={**body(2, 400), "stream": True}, headers={"Authorization": f"Bearer {KEY}"}
        ) as response:
            event_id = None
            async for line in response.content:
                if line.startswith(b"id: "):
                    event_id = line[4:].strip().decode()
                    break
            request_id = event_id.rsplit(".", 1)[0]
            await asyncio.sleep(0.2)  # its record is written

            status, raw = await post({"Last-Event-ID": event_id}, {**body(2, 400), "stream": True}, OTHER_TENANT_KEY)
            assert status == 403 and b"tenant" in raw, raw
            status, raw = await post({"Last-Event-ID": event_id}, {**body(3, 400), "stream": True})
            assert status == 400 and b"not that request" in raw, raw
            status, raw = await post({"Last-Event-ID": event_id}, {**body(2, 400), "stream": False})
            assert status == 400 and b"stream: true" in raw, raw
    for malformed in ("no-dot", "x.y", "a b.3", ""):
        status, raw = await post({"Last-Event-ID": malformed})
        assert status == 400 and b"Last-Event-ID" in raw, (malformed, raw)
    status, raw = await post({"Last-Event-ID": "gw-never-seen.4"})
    assert status == 404 and b"no gateway relays" in raw, raw

    # The first stream was left when its client went away; a short one finishes, and is then "ended".
    async with aiohttp.ClientSession() as session:
        chunks = await collect(session, [base], body(4, 5))
    assert text_of(chunks)

    def ended() -> list[str]:  # the gateway writes it once its relay is over, a moment after the client's [DONE]
        over = cluster.client.scan_iter(match=cluster.keys.stream_over("*"))
        return [k for k in over if request_id not in k]

    finished = await asyncio.to_thread(wait_for, ended, 5, 0.05, "a finished stream leaves its end behind")
    over_id = finished[0].rsplit(":", 1)[1]
    status, raw = await post({"Last-Event-ID": f"{over_id}.3"}, {**body(4, 5), "stream": True})
    assert status == 404 and b"it ended (ok)" in raw, raw


async def test_a_plain_client_cannot_attach_to_a_held_stream():
    """`lifeline.attach` takes a held request's tokens: only a gateway (with the agent token) may."""
    from workers.openai_schema import Extension

    with pytest.raises(Exception, match="lifeline.attach"):
        Extension.parse({"attach": 3})  # no request id
    with pytest.raises(Exception, match="lifeline.attach"):
        Extension.parse({"request_id": "r1", "attach": -1})
    assert Extension.parse({"request_id": "r1", "attach": 3.0}).attach == 3


async def test_attach_without_the_agent_token_is_refused(cluster):
    (node,) = cluster.start_nodes("tk-f")
    status, answer = await asyncio.to_thread(
        http_json,
        node.address + "/v1/chat/completions",
        data={**body(5), "stream": True, "lifeline": {"request_id": "tk-f-1", "attach": 2}},
    )
    assert status == 401 and "agent token" in answer["error"]["message"]


async def test_several_gateway_processes_share_one_port(cluster, tmp_path):
    """`--reuse-port`: gateway processes on one host share a port (SO_REUSEPORT), the kernel spreads connections,
    and each serves from the shared routing table."""
    from console.stack import free_port

    cluster.start_nodes("tk-g")
    port = free_port()
    env = {**os.environ, "LIFELINE_NAMESPACE": cluster.keys.namespace, "LIFELINE_AGENT_TOKEN": AGENT}
    procs = [
        subprocess.Popen(
            [sys.executable, "manage.py", "gateway", "--port", str(port), "--name", f"gw-port-{i}", "--reuse-port"],
            cwd=BASE_DIR,
            env={**env, "LIFELINE_VAR_DIR": str(tmp_path / str(i))},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for i in range(2)
    ]
    base = f"http://127.0.0.1:{port}"
    try:
        seen: set[str] = set()

        def both_answer() -> bool:
            for _ in range(20):  # each call a new connection: the kernel picks a process for each
                try:
                    status, health = http_json(base + "/healthz", timeout=2)
                except OSError:
                    return False
                if status == 200 and health["watching"] == ["tk-g"]:
                    seen.add(health["gateway"])
            return seen == {"gw-port-0", "gw-port-1"}

        await asyncio.to_thread(wait_for, both_answer, 30, 0.2, "both gateways answering on one port")
        async with aiohttp.ClientSession() as session:
            chunks = await collect(session, [base], body(6, 8))
        assert text_of(chunks)
        assert [p.poll() for p in procs] == [None, None]
    finally:
        for proc in procs:
            proc.kill()
