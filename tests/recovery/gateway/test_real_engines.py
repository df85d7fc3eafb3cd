"""Real engines behind the gateway: llama.cpp's llama-server, serving a Llama of random weights, fronted by
node agents, routed, watched, canaried and resumed without a lost token, beside emulated nodes.

The engine is llama.cpp built from source once per machine (harness/real_engine.py); the model is
generated here (tests/real_engine.tiny_model): its compute is a real transformer's, its text is noise.
"""

import asyncio
import signal
import threading

import openai
import pytest

from harness.real_engine import LlamaServer, tiny_model
from recovery import canary
from recovery.gateway.app import COORDINATOR_KEY
from recovery.policy.health import GoldenToken, judge_canary
from tests.gateway_cluster import KEY
from tests.helpers import chat_stream, http_json, wait_for

MODEL = "Tiny-Llama"
SERVED_AS = "lifeline/tiny-llama"  # the catalog's name for it, as llama-server's alias
OFFERS = ["openai", "events", "resume", "telemetry"]
ENV = {"LIFELINE_AGENT_TOKEN": "agent-token-for-tests"}


@pytest.fixture
def real_fleet(cluster, node_factory, tmp_path):
    """`start(n, seed=0)`: n llama-servers on the tiny model, each behind a node agent in the cluster's routes."""
    servers: list[LlamaServer] = []

    def start(count: int, seed: int = 0, first: int = 0, parallel: int = 4, extra=()) -> list[LlamaServer]:
        model = tiny_model(tmp_path / f"tiny-{seed}.gguf", seed=seed)
        started = []
        for i in range(first, first + count):
            log = tmp_path / f"llama-{i}.log"
            server = LlamaServer(model, alias=SERVED_AS, parallel=parallel, log_path=log, extra_args=extra).start()
            servers.append(server)
            started.append(server)
            name = f"real-{i}"
            node = node_factory(name, "--engine-url", server.url, "--model", MODEL, env=ENV)
            wait_for(lambda n=node: http_json(n.address + "/health")[0] == 200, 20, 0.1, f"{name} sees its engine")
            cluster.add_node(name, node, model=MODEL, capabilities=OFFERS, rack="rack-a" if i % 2 == 0 else "rack-b")
        return started

    yield start
    for server in servers:
        server.stop()


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)


def stream_text(base: str, prompt: str, max_tokens: int, on_token=None) -> tuple[str, list[str], str]:
    """A chat stream through the gateway with the official client: (text, SSE comments, the first node)."""
    return chat_stream(base, KEY, MODEL, prompt, on_token, max_tokens=max_tokens, temperature=0)


async def test_the_openai_client_reaches_a_real_engine_through_the_gateway_beside_emulated_nodes(cluster, real_fleet):
    cluster.start_nodes("emu-1")
    real_fleet(2)
    base = await cluster.gateway()
    co = cluster.servers[0].app[COORDINATOR_KEY]
    models = {m.id for m in await asyncio.to_thread(lambda: list(client(base).models.list()))}
    assert {MODEL, "Qwen3-32B"} <= models

    # Not streamed and streamed, completion and chat: the same greedy text either way.
    done = await asyncio.to_thread(
        lambda: client(base).completions.create(model=MODEL, prompt="The fleet", max_tokens=40, temperature=0)
    )
    assert done.usage.completion_tokens == 40 and len(done.choices[0].text) > 0
    streamed = await asyncio.to_thread(
        lambda: "".join(
            c.choices[0].text
            for c in client(base).completions.create(
                model=MODEL, prompt="The fleet", max_tokens=40, temperature=0, stream=True
            )
            if c.choices
        )
    )
    assert streamed == done.choices[0].text
    chat = await asyncio.to_thread(
        lambda: client(base).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=30, temperature=0
        )
    )
    text, comments, _ = await asyncio.to_thread(stream_text, base, "hello", 30)
    assert chat.choices[0].message.content == text and not comments
    # The emulated model is served beside it, by its own node.
    emulated = await asyncio.to_thread(
        lambda: client(base).completions.with_raw_response.create(model="Qwen3-32B", prompt="x", max_tokens=5)
    )
    assert emulated.headers["x-lifeline-node"] == "emu-1"

    # Routing sees the real engines' load: four long streams spread over both, each node's status shows its own.
    seen: dict[str, int] = {}
    peak: dict[str, int] = {}

    def watch(count, node):
        seen[node] = seen.get(node, 0) + (count == 1)
        for name in ("real-0", "real-1"):
            peak[name] = max(peak.get(name, 0), co.watcher.status(name).decode_batch)

    texts = await asyncio.gather(*(asyncio.to_thread(stream_text, base, f"load {i}", 400, watch) for i in range(4)))
    assert all(len(t[0]) > 0 for t in texts)
    assert set(seen) == {"real-0", "real-1"}, seen  # least load, as each node's own status told it
    assert peak["real-0"] >= 1 and peak["real-1"] >= 1, peak
    # No holders on a node that cannot stream KV, so no 501 and nothing counted against a node.
    await cluster.flushed()
    assert cluster.signals("node_error") == [] and cluster.signals("request_failed") == []


# Greedy text is the same on every run only where the engine's arithmetic does not depend on how a context was
# computed: llama.cpp as LlamaServer starts it (no flash attention, an f32 KV cache). With llama-server's defaults
# a prompt computed in one batch and the same tokens decoded one at a time differ enough to flip a near-tie:
# 18 of 192 re-prefilled continuations of this model took another token (harness/real_engine.py).


async def test_every_stream_resumes_when_a_real_engine_is_killed_and_the_text_is_identical(cluster, real_fleet):
    servers = real_fleet(2)
    cluster.config["placement_policy"] = "lifeline"  # the default policy: holders wherever a node can hold them
    cluster.publish()
    base = await cluster.gateway()
    prompts = [f"Stream number {i} tells the operator what happened" for i in range(4)]
    undisturbed = await asyncio.gather(*(asyncio.to_thread(stream_text, base, p, 300) for p in prompts))

    killed: list[str] = []
    lock = threading.Lock()

    def kill_at_40(count, node):
        with lock:
            if count == 40 and not killed:
                killed.append(node)
                servers[int(node.split("-")[1])].kill(signal.SIGKILL)  # the engine, not the node agent

    disturbed = await asyncio.gather(*(asyncio.to_thread(stream_text, base, p, 300, kill_at_40) for p in prompts))
    assert killed
    assert any(d[2] == killed[0] for d in disturbed), "some streams were on the killed engine"
    # A stream moved is one the gateway told so; that includes a stream that had not had its first token from the
    # killed engine yet (its headers already name the node it moved to, and its comment says token 0).
    moved = [d for d in disturbed if any("lifeline moved this stream" in c for c in d[1])]
    for (text, comments, node), (reference, _, _) in zip(disturbed, undisturbed):
        where = next((i for i, (a, b) in enumerate(zip(text, reference)) if a != b), min(len(text), len(reference)))
        # No token lost, none repeated: at temperature 0 the same text.
        assert text == reference, (node, killed, comments, where, len(text), len(reference))
        if node == killed[0]:  # every stream that was streaming from the killed engine was moved
            assert any("lifeline moved this stream" in c and "re-prefill" in c for c in comments), comments
    await cluster.flushed()
    moves = cluster.signals("request_moved")
    assert len(moves) == len(moved), moves
    assert all(m["method"] == "re-prefill" and m["to"] != killed[0] for m in moves), moves


def _golden(reply: canary.Reply) -> list[GoldenToken]:
    return [GoldenToken(t, top) for t, top in zip(reply.answer.token_ids, reply.answer.top_logprobs)]


async def test_a_canary_golden_run_from_a_real_engine_passes_and_catches_different_weights(
    cluster, real_fleet, node_factory, tmp_path
):
    [server] = real_fleet(1)
    node = cluster.nodes["real-0"]
    prompt = {"key": "capital", "prompt": "The capital of France is", "max_tokens": 3}
    recorded = await asyncio.to_thread(canary.ask, node.address, MODEL, prompt, 10)
    golden = _golden(recorded)
    assert len(golden) == 3 and all(g.top_logprob is not None for g in golden)  # real tokens and log probabilities
    again = await asyncio.to_thread(canary.ask, node.address, MODEL, prompt, 10)
    verdict = judge_canary(golden, again.answer, None)
    assert verdict.passed, verdict

    # The engine restarts on other weights: from outside, that is what silent corruption looks like.
    server.stop()
    other = LlamaServer(tiny_model(tmp_path / "tiny-7.gguf", seed=7), alias=SERVED_AS, log_path=tmp_path / "l7.log")
    other.start()
    try:
        node_b = node_factory("real-b", "--engine-url", other.url, "--model", MODEL, env=ENV)
        wait_for(lambda: http_json(node_b.address + "/health")[0] == 200, 20, 0.1, "real-b sees its engine")
        corrupt = await asyncio.to_thread(canary.ask, node_b.address, MODEL, prompt, 10)
        verdict = judge_canary(golden, corrupt.answer, None)
        assert not verdict.passed and verdict.kind in ("token_mismatch", "logprob_out_of_range"), verdict
    finally:
        other.stop()


async def test_a_drain_moves_a_real_engines_streams_by_re_prefill_without_a_gap(cluster, real_fleet):
    real_fleet(2)
    base = await cluster.gateway()
    co = cluster.servers[0].app[COORDINATOR_KEY]
    prompt = "A planned move, while the stream runs"
    reference, _, _ = await asyncio.to_thread(stream_text, base, prompt, 300)
    loop = asyncio.get_running_loop()
    results: list[dict] = []

    def move_at_30(count, node):
        if count == 30 and not results:
            results.append(asyncio.run_coroutine_threadsafe(co.migrate_node(node, "drain-1"), loop).result(5))

    text, comments, first = await asyncio.to_thread(stream_text, base, prompt, 300, move_at_30)
    [result] = results
    assert result["node"] == first and result["reprefill"] == 1 and result["failed"] == 0
    assert text == reference
    assert any("lifeline moved this stream" in c and first in c for c in comments), comments
    await cluster.flushed()
    [move] = cluster.signals("request_moved")
    assert move["kind"] == "planned" and move["from"] == first and move["to"] != first
