"""KV checkpointing, restore-and-resume and live migration between real node processes.

The core correctness check of the product: whatever happens to the node, the
text a client ends up with equals the undisturbed run, token for token.
"""

import asyncio
import json
import signal

import aiohttp
import pytest

from tests.helpers import http_json, wait_for

AGENT = "agent-token-for-tests"
ENV = {"LIFELINE_AGENT_TOKEN": AGENT}
HEAD = {"Authorization": f"Bearer {AGENT}"}
SCALE = ("--time-scale", "0.2")
PROMPT = "Summarize the incident timeline for the failed node in rack b " * 12


def peer(node, rack="rack-a"):
    return {"name": node.name, "address": node.address, "rack": rack}


def body(request_id, **lifeline):
    return {
        "model": "Qwen3-32B",
        "prompt": PROMPT,
        "max_tokens": 120,
        "temperature": 0.8,
        "seed": 1234,
        "stream": True,
        "lifeline": {"request_id": request_id, "return_token_ids": True, **lifeline},
    }


class Stream:
    """One SSE response, read chunk by chunk: token ids, text, and Lifeline's extension."""

    def __init__(self):
        self.ids, self.text, self.extensions, self.finish, self.headers, self.error = [], "", [], None, {}, None

    async def read(self, response, stop_after: int | None = None):
        self.headers = dict(response.headers)
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                self.error = chunk["error"]
                return self
            if "lifeline" in chunk:
                self.extensions.append(chunk["lifeline"])
            choice = chunk["choices"][0]
            self.ids += choice.get("token_ids", [])
            self.text += choice.get("text", "")
            self.finish = choice["finish_reason"] or self.finish
            if stop_after is not None and len(self.ids) >= stop_after:
                return self
        return self


async def run(address, payload, headers=HEAD, stop_after=None, on_tokens=None) -> Stream:
    stream = Stream()
    async with aiohttp.ClientSession() as session:
        async with session.post(address + "/v1/completions", json=payload, headers=headers) as response:
            assert response.status == 200, await response.text()
            await stream.read(response, stop_after)
    return stream


async def run_until_killed(node, payload, holder, tokens: int, min_committed: int) -> Stream:
    """Stream from `node`, and after `tokens` tokens (and their pages on `holder`) SIGKILL it
    while the connection is still open, as a GPU failure does to a gateway's stream."""
    stream = Stream()
    async with aiohttp.ClientSession() as session:
        async with session.post(node.address + "/v1/completions", json=payload, headers=HEAD) as response:
            assert response.status == 200, await response.text()
            await stream.read(response, stop_after=tokens)
            if holder is not None:
                request_id = payload["lifeline"]["request_id"]
                await asyncio.to_thread(
                    wait_for,
                    lambda: (c := checkpoint_of(holder, request_id)) and c["committed_tokens"] >= min_committed,
                    5,
                    0.02,
                    "pages on the holder",
                )
            node.kill(signal.SIGKILL)
            with pytest.raises(aiohttp.ClientPayloadError):
                await stream.read(response)  # the stream breaks: nothing after the kill
    return stream


async def reference(node) -> Stream:
    undisturbed = await run(node.address, body("reference-run"))
    assert undisturbed.finish == "length" and len(undisturbed.ids) == 120
    return undisturbed


def checkpoint_of(holder, request_id):
    status, answer = http_json(f"{holder.address}/agent/kv/{request_id}", headers=HEAD)
    return answer if status == 200 else None


@pytest.fixture
def fleet(node_factory):
    def start(*names):
        return [node_factory(name, *SCALE, env=ENV) for name in names]

    return start


async def test_checkpointed_request_killed_mid_stream_resumes_on_its_holder_with_identical_text(fleet):
    a, b = fleet("ck-a", "ck-b")
    expected = await reference(b)
    first = await run_until_killed(a, body("r-kill", holders=[peer(b)]), b, 60, 48 + len(PROMPT.split()))
    held = checkpoint_of(b, "r-kill")
    assert held["source"] == "ck-a" and held["bytes"] == held["blocks"] * 16 * 256 * 1024  # real KV bytes accounted

    second = await run(b.address, body("r-kill", resume={"generated_token_ids": first.ids}))
    assert second.headers["X-Lifeline-Resume"] == "checkpoint-local"
    resume = second.extensions[0]["resume"]
    assert resume["method"] == "checkpoint-local" and resume["restored_tokens"] >= len(PROMPT.split())
    assert resume["restored_tokens"] + resume["reprefill_tokens"] == len(PROMPT.split()) + len(first.ids)
    assert resume["restore_ms"] > 0  # host memory to GPU over PCIe
    assert first.ids + second.ids == expected.ids  # none lost, none repeated
    assert first.text + second.text == expected.text
    assert checkpoint_of(b, "r-kill") is None  # restored into GPU memory, the host copy is freed


async def test_resume_fetches_pages_from_a_remote_holder(fleet):
    a, b, c = fleet("fx-a", "fx-b", "fx-c")
    expected = await reference(c)
    first = await run_until_killed(a, body("r-fetch", holders=[peer(b, "rack-b")]), b, 50, 32 + len(PROMPT.split()))
    second = await run(
        c.address, body("r-fetch", resume={"generated_token_ids": first.ids, "sources": [peer(b, "rack-b")]})
    )
    resume = second.extensions[0]["resume"]
    assert resume["method"] == "checkpoint-fetched" and resume["source"] == "fx-b" and resume["restored_tokens"] > 0
    assert first.ids + second.ids == expected.ids


async def test_resume_without_pages_re_prefills_and_says_so(fleet):
    (a, c) = fleet("rp-a", "rp-c")
    expected = await reference(c)
    first = await run_until_killed(a, body("r-plain"), None, 30, 0)
    second = await run(c.address, body("r-plain", resume={"generated_token_ids": first.ids}))
    assert second.headers["X-Lifeline-Resume"] == "re-prefill"
    resume = second.extensions[0]["resume"]
    assert resume["method"] == "re-prefill" and "no pages" in resume["reason"]
    assert resume["reprefill_tokens"] == len(PROMPT.split()) + len(first.ids)
    assert first.ids + second.ids == expected.ids


async def test_live_migration_hands_over_at_a_token_boundary(fleet):
    a, b = fleet("mg-a", "mg-b")
    expected = await reference(b)
    streamed = Stream()

    async def client():
        async with aiohttp.ClientSession() as session:
            async with session.post(a.address + "/v1/completions", json=body("r-move"), headers=HEAD) as response:
                await streamed.read(response)

    task = asyncio.create_task(client())
    await asyncio.to_thread(wait_for, lambda: len(streamed.ids) >= 40, 10, 0.01, "40 tokens")
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"{a.address}/agent/requests/r-move/migrate", json={"target": peer(b)}, headers=HEAD
        ) as response:
            assert response.status == 200, await response.text()
            moved = await response.json()
    await task
    # The source's stream ended with a note of the move, and carried every token up to it.
    assert streamed.extensions[-1]["migrated"]["tokens"] == moved["tokens"] == len(streamed.ids)
    assert moved["generated_token_ids"] == streamed.ids and moved["blocks"] > 0 and moved["link"] == "infiniband"
    second = await run(b.address, body("r-move", resume={"generated_token_ids": moved["generated_token_ids"]}))
    resume = second.extensions[0]["resume"]
    assert resume["method"] == "checkpoint-local" and resume["restore_ms"] == 0  # already in GPU memory
    assert resume["restored_tokens"] == moved["kv_tokens"]
    assert streamed.ids + second.ids == expected.ids
    assert http_json(f"{a.address}/agent/status")[1]["counters"]["migrated_out"] == 1


async def test_holder_pushes_a_status_for_each_page_and_frees_pages_when_the_request_ends(fleet):
    a, b = fleet("ev-a", "ev-b")
    statuses = []

    async def watch():
        async with aiohttp.ClientSession() as session:
            async with session.get(b.address + "/agent/events") as events:
                async for raw in events.content:
                    if raw.startswith(b"data: "):
                        statuses.append(json.loads(raw[6:]))

    watcher = asyncio.create_task(watch())
    done = await run(a.address, {**body("r-ev", holders=[peer(b)]), "max_tokens": 60})
    assert done.finish == "length"
    await asyncio.to_thread(
        wait_for,
        lambda: statuses and statuses[-1]["checkpoint_bytes_held"] == 0 and len(statuses) > 2,
        5,
        0.05,
        "pages dropped",
    )
    watcher.cancel()
    held = [s["checkpoint_bytes_held"] for s in statuses if s.get("reason") == "checkpoint"]
    assert max(held) > 0 and held[-1] == 0
    assert all(s["checkpoint_budget_bytes"] > 0 for s in statuses)
    # Every page arrived in order: nothing was streamed after the request ended and its pages were dropped.
    checkpoints = http_json(f"{b.address}/agent/status")[1]["checkpoints"]
    assert checkpoints["refused_order"] == 0 and checkpoints["refused_digest"] == 0 and checkpoints["dropped"] == 1


async def test_a_sender_stops_streaming_a_request_its_holder_refused(node_factory):
    """A full holder refuses the request with the shortest prefix; its later pages could not be
    stored either, so the serving node stops sending them instead of having each refused."""
    from workers import catalog
    from workers.checkpoint import CheckpointStreamer, Peer

    # 1 GB of host memory, 2.2% of it for checkpoints: 22 MB, room for five 4 MiB pages of Qwen3-32B.
    holder = node_factory("rf-b", *SCALE, "--host-memory-gb", "1", "--checkpoint-budget", "0.022", env=ENV)
    streamer = CheckpointStreamer("rf-a", catalog.model("Qwen3-32B"), HEAD, flush_s=0.01)
    target = Peer(holder.name, holder.address)
    try:
        for block in range(5):
            streamer.page(target, "r-long", block, list(range(16 * block, 16 * block + 16)))
        await wait_until(lambda: streamer.pending() == 0)
        for block in range(12):  # one page at a time, as decode produces them
            streamer.page(target, "r-short", block, list(range(16 * block, 16 * block + 16)))
            await asyncio.sleep(0.03)
        await wait_until(lambda: streamer.pending() == 0)
    finally:
        await streamer.close()
    stats = http_json(f"{holder.address}/agent/status")[1]["checkpoints"]
    assert stats["refused_budget"] == 1 and stats["refused_order"] == 0, stats  # refused once, then no more sent
    assert streamer.counters["pages_refused"] == 1 and streamer.counters["pages_sent"] == 6, streamer.counters
    assert checkpoint_of(holder, "r-long")["blocks"] == 5 and checkpoint_of(holder, "r-short") is None


async def wait_until(predicate, timeout_s=10.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.1)  # the last batch's answer


def test_pages_with_a_bad_digest_or_out_of_order_are_refused(fleet):
    from workers import catalog
    from workers.checkpoint import make_page

    (b,) = fleet("bp-b")
    model = catalog.model("Qwen3-32B")
    good = [
        make_page("r-bad", i, list(range(16 * i, 16 * i + 16)), model, 1 / 4096).to_wire("r-bad", i + 1)
        for i in range(3)
    ]
    tampered = dict(good[1], digest="0" * 32)
    status, answer = http_json(
        f"{b.address}/agent/kv/batch",
        headers=HEAD,
        data={
            "source": "x",
            "model": "Qwen3-32B",
            "pages": [good[0], tampered, good[2]],
            "commits": [{"request_id": "r-bad", "seq": 3, "tokens": 48}],
        },
    )
    assert status == 200 and answer["accepted"] == 1
    assert [r["reason"] for r in answer["refused"]] == ["digest", "order"]
    assert checkpoint_of(b, "r-bad")["committed_tokens"] == 0  # the commit is past what it holds
    stats = http_json(f"{b.address}/agent/status")[1]["checkpoints"]
    assert stats["refused_digest"] == 1 and stats["refused_order"] == 1
    status, answer = http_json(
        f"{b.address}/agent/kv/batch", headers=HEAD, data={"source": "x", "model": "Llama-3-8B", "pages": []}
    )
    assert status == 400 and answer["error"]["param"] == "model"


def test_control_calls_need_the_agent_token(fleet, node_factory):
    a, b = fleet("tk-a", "tk-b")
    status, answer = http_json(a.address + "/v1/completions", data={**body("r-x", holders=[peer(b)]), "stream": False})
    assert status == 401 and answer["error"]["param"] == "lifeline"
    assert http_json(f"{a.address}/agent/kv/batch", data={})[0] == 401
    assert http_json(f"{a.address}/agent/kv/batch", data={}, headers={"Authorization": "Bearer wrong"})[0] == 401
    assert http_json(f"{a.address}/agent/requests/r-x/migrate", data={"target": peer(b)})[0] == 401
    plain = node_factory("tk-none", *SCALE)  # started without LIFELINE_AGENT_TOKEN
    status, answer = http_json(f"{plain.address}/agent/kv/batch", data={}, headers=HEAD)
    assert status == 503 and "LIFELINE_AGENT_TOKEN" in answer["error"]["message"]


def test_the_official_openai_client_streams_from_a_node(fleet):
    import openai

    (a,) = fleet("oa-a")
    client = openai.OpenAI(base_url=a.address + "/v1", api_key="unused", max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model="Qwen3-32B",
            messages=[{"role": "user", "content": "Is node seven healthy?"}],
            max_tokens=20,
            temperature=0,
            stream=True,
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "length"
    whole = client.chat.completions.create(
        model="Qwen3-32B",
        messages=[{"role": "user", "content": "Is node seven healthy?"}],
        max_tokens=20,
        temperature=0,
    )
    assert whole.choices[0].message.content == streamed and whole.usage.completion_tokens == 20
    completion = client.completions.create(
        model="Qwen3-32B",
        prompt="The canary says",
        max_tokens=8,
        temperature=0,
        logprobs=2,
        extra_body={"lifeline": {"request_id": "oa-1"}},
    )
    assert completion.id == "oa-1" and len(completion.choices[0].logprobs.token_logprobs) == 8
    logprobs, text = completion.choices[0].logprobs, completion.choices[0].text
    assert "".join(logprobs.tokens) == text  # each token's string is the text it adds, spaces and capitals kept
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(8)]
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.completions.create(model="Qwen3-32B", prompt="x", max_tokens=-1)
    assert "max_tokens" in str(excinfo.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="Llama-3-70B", prompt="x")


async def test_a_resumed_request_checkpoints_its_whole_prefix_on_its_new_holder(fleet):
    # Resumed on b after a's death, the request streams to a new holder c: c must get the
    # blocks restored from the checkpoint too, or a second failure would lose them.
    a, b, c = fleet("rh-a", "rh-b", "rh-c")
    first = await run_until_killed(a, body("r-again", holders=[peer(b)]), b, 40, 32 + len(PROMPT.split()))
    async with aiohttp.ClientSession() as session:
        payload = body("r-again", holders=[peer(c)], resume={"generated_token_ids": first.ids})
        async with session.post(b.address + "/v1/completions", json=payload, headers=HEAD) as response:
            second = await Stream().read(response, stop_after=20)
            restored = second.extensions[0]["resume"]["restored_tokens"]
            held = await asyncio.to_thread(
                wait_for,
                lambda: (k := checkpoint_of(c, "r-again")) and k["committed_tokens"] > restored and k,
                5,
                0.02,
                "pages on the new holder",
            )
    assert held["blocks"] * 16 > restored and held["source"] == "rh-b"
    assert http_json(f"{c.address}/agent/status")[1]["checkpoints"]["refused_order"] == 0


async def test_a_holder_restarted_at_a_new_address_gets_the_pages_sent_to_it(fleet, node_factory):
    a, b = fleet("ra-a", "ra-b")
    done = await run(a.address, {**body("r-before", holders=[peer(b)]), "max_tokens": 40})
    assert done.finish == "length"
    b.kill(signal.SIGKILL)
    await asyncio.sleep(5.5)  # long enough for the streamer to give up on the old b
    reborn = node_factory("ra-b", *SCALE, env=ENV)  # same name, another port
    assert reborn.address != b.address
    stream = Stream()
    # Long enough to still run while the holder is asked: a request that ends drops its checkpoint.
    payload = {**body("r-after", holders=[peer(reborn)]), "max_tokens": 4000}
    async with aiohttp.ClientSession() as session:
        async with session.post(a.address + "/v1/completions", json=payload, headers=HEAD) as response:
            await stream.read(response, stop_after=40)
            held = await asyncio.to_thread(
                wait_for, lambda: checkpoint_of(reborn, "r-after"), 5, 0.05, "pages on the restarted holder"
            )
    assert held["blocks"] > 0
