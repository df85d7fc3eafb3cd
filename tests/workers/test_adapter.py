"""A node fronting a real engine's API: each engine's dialect, the adapter's own load account, resume by
re-prefill, and the refusal of an engine that does not answer as the adapter needs.

The vLLM dialect runs here against our emulated node, which serves vLLM's API surface (its /tokenize,
/v1/completions with token ids as the prompt and `return_token_ids`, its metric names), and against vLLM
itself (its CPU build) in tests/recovery/gateway/test_vllm_engine.py; the llama.cpp dialect runs against a
real llama-server in tests/workers/test_real_engine.py and tests/e2e. SGLang cannot run on this machine
(it needs a GPU build): its dialect is read against the messages its documentation shows.
"""

import asyncio
import contextlib
import json
import threading
import urllib.request

import aiohttp
import pytest
from aiohttp import web

from tests.helpers import NodeProcess, buffered_burst, http_json, longest_hold_of_the_loop, sse_choices, wait_for
from workers import catalog
from workers.adapter import (
    YIELD_EVERY,
    AdapterEngine,
    EngineMismatch,
    LlamaCpp,
    Sglang,
    Vllm,
    _events,
    detect,
    parse_metrics,
)
from workers.engine_api import CAPABILITIES, FinishEvent, TokenEvent
from workers.openai_schema import parse

AGENT = "adapter-agent-token"
AGENT_HEAD = {"Authorization": f"Bearer {AGENT}"}
ENV = {"LIFELINE_AGENT_TOKEN": AGENT}


# --- each engine's metrics and messages ----------------------------------------------------------


def test_each_dialect_reads_its_engines_series_summed_over_label_sets():
    vllm = """# HELP vllm:num_requests_running x
vllm:num_requests_running{model_name="a",engine="0"} 3.0
vllm:num_requests_running{model_name="a",engine="1"} 2.0
vllm:num_requests_waiting{model_name="a"} 7
vllm:gpu_cache_usage_perc{model_name="a"} 0.25
vllm:generation_tokens_total{model_name="a"} 1.5e3
"""
    assert Vllm().figures(vllm) == {"running": 5.0, "waiting": 7.0, "kv_usage": 0.25, "generation_tokens": 1500.0}
    sglang = (
        'sglang:num_running_reqs{model_name="m"} 4\nsglang:num_queue_reqs{model_name="m"} 1\nsglang:token_usage 0.5\n'
    )
    assert Sglang().figures(sglang) == {"running": 4.0, "waiting": 1.0, "kv_usage": 0.5}
    llama = "llamacpp:requests_processing 2\nllamacpp:requests_deferred 3\nllamacpp:tokens_predicted_total 99\n"
    assert LlamaCpp().figures(llama) == {"running": 2.0, "waiting": 3.0, "generation_tokens": 99.0}
    assert (detect(vllm), detect(sglang), detect(llama), detect("process_cpu_seconds_total 1\n")) == (
        "vllm",
        "sglang",
        "llamacpp",
        None,
    )
    assert parse_metrics("a 1\nb 2\n", {"b": "x"}) == {"x": 2.0}


def test_llama_cpp_chunks_carry_ids_logprobs_and_the_stop():
    dialect = LlamaCpp()

    def message(token_id, text, content, logprob=-0.1):
        return {
            "content": content,
            "tokens": [token_id],
            "stop": False,
            "completion_probabilities": [
                {
                    "id": token_id,
                    "token": text,
                    "bytes": list(text.encode()),
                    "logprob": logprob,
                    "top_logprobs": [{"id": token_id, "token": text, "logprob": logprob}, {"id": 9, "logprob": -3}],
                }
            ],
        }

    state = {"logprobs": 1}
    [piece] = dialect.read(message(412, " cat", " cat"), state).pieces
    assert (piece.token_id, piece.text, piece.logprob, piece.token, piece.top) == (
        412,
        " cat",
        -0.1,
        " cat",
        ((" cat", -0.1),),  # as many candidates as the client asked for
    )
    # llama-server holds text back while it could be a stop word: each token's text comes from its own bytes, so
    # a node dying with text held back loses none of it.
    held = [dialect.read(message(7, " ye", ""), {}).pieces[0], dialect.read(message(8, "ar", " year"), {}).pieces[0]]
    assert [(p.token_id, p.text, p.logprob) for p in held] == [(7, " ye", None), (8, "ar", None)]
    # A character split over two tokens comes out whole with the second.
    state = {"logprobs": None}
    split = [dialect.read(_bytes_message(b), state).pieces[0].text for b in (b"\xc3", b"\xa9")]
    assert split == ["", "é"]
    end = dialect.read({"content": "", "tokens": [], "stop": True, "stop_type": "limit", "tokens_predicted": 9}, {})
    assert end.pieces == [] and end.finish == "length" and end.usage["completion_tokens"] == 9
    assert dialect.read({"stop": True, "stop_type": "eos"}, {}).finish == "stop"
    path, body = dialect.generation(
        "m", [1, 2, 3], parse({"model": "m", "prompt": "x", "max_tokens": 10}, "completion"), 4
    )
    assert path == "/completion" and body["prompt"] == [1, 2, 3] and body["n_predict"] == 6
    assert body["return_tokens"] is True and body["top_k"] == 0 and body["min_p"] == 0.0  # OpenAI's sampling


def _bytes_message(raw: bytes) -> dict:
    return {"tokens": [3], "stop": False, "completion_probabilities": [{"id": 3, "bytes": list(raw), "logprob": -1}]}


def test_sglang_streams_the_output_so_far_and_only_the_new_tokens_are_read():
    dialect, state = Sglang(), {}
    first = dialect.read({"text": "Hi", "meta_info": {"output_token_logprobs": [[-0.5, 17, "Hi"]]}}, state)
    second = dialect.read(
        {
            "text": "Hi there",
            "meta_info": {
                "output_token_logprobs": [[-0.5, 17, "Hi"], [-0.2, 29, " there"]],
                "finish_reason": {"type": "length", "length": 2},
                "prompt_tokens": 5,
                "completion_tokens": 2,
            },
        },
        state,
    )
    assert [(p.token_id, p.text) for p in first.pieces] == [(17, "Hi")]
    assert [(p.token_id, p.text, p.logprob) for p in second.pieces] == [(29, " there", -0.2)]
    assert second.finish == "length" and second.usage == {"prompt_tokens": 5, "completion_tokens": 2}


# --- the vLLM dialect, against a node serving vLLM's API ------------------------------------------


async def test_the_adapter_generates_from_the_engines_ids_and_accounts_its_load(node_factory):
    engine = node_factory("vllm-like", "--time-scale", "1")
    adapter = node_factory(
        "adapter-1", "--engine-url", engine.address, "--engine-kind", "vllm", "--model", "Qwen3-32B", env=ENV
    )
    wait_for(lambda: http_json(adapter.address + "/health")[0] == 200, 10, 0.1, "adapter sees the engine")
    body = {"model": "Qwen3-32B", "prompt": "fronted request", "max_tokens": 12, "temperature": 0}
    direct = http_json(engine.address + "/v1/completions", data=body)[1]["choices"][0]["text"]
    status, through = http_json(adapter.address + "/v1/completions", data={**body, "lifeline": {"request_id": "a-1"}})
    assert status == 200 and through["choices"][0]["text"] == direct

    # The adapter's own account: a long stream is one request decoding, its context and step time measured.
    events: list[dict] = []

    async def watch_events():
        async with aiohttp.ClientSession() as session:
            async with session.get(adapter.address + "/agent/events") as response:
                async for raw in response.content:
                    if raw.startswith(b"data: "):
                        events.append(json.loads(raw[6:]))

    watcher = asyncio.create_task(watch_events())

    async def long_stream():
        async with aiohttp.ClientSession() as session:
            async with session.post(
                adapter.address + "/v1/completions",
                json={**body, "max_tokens": 100, "stream": True, "lifeline": {"request_id": "long-1"}},
            ) as response:
                assert response.headers["X-Lifeline-Node"] == "adapter-1"
                return [raw async for raw in response.content if raw.startswith(b"data: {")]

    task = asyncio.create_task(long_stream())
    load = await asyncio.to_thread(
        wait_for,
        lambda: (
            (s := http_json(adapter.address + "/agent/status")[1]["load"])["decode_batch"] == 1 and s["step_ms"] and s
        ),
        5,
        0.05,
        "one request decoding",
    )
    assert load["source"] == "engine_metrics" and load["running"] == 1 and load["in_flight"] == 1
    assert load["decode_context_tokens"] > len("fronted request".split()) and load["step_ms"] > 0
    assert len(await task) == 101  # 100 tokens and the finish chunk
    await asyncio.sleep(0.3)
    watcher.cancel()
    reasons = [(e.get("reason"), e.get("request_id")) for e in events]
    assert ("arrival", "long-1") in reasons and ("finished", "long-1") in reasons  # the gateway's ledger settles
    assert reasons.index(("arrival", "long-1")) < reasons.index(("admitted", "long-1"))

    # Capabilities: resume (by re-prefill), no checkpoint: holders are refused, never half-served.
    capabilities = http_json(adapter.address + "/agent/capabilities")[1]
    assert "resume" in capabilities["offers"] and "checkpoint" not in capabilities["offers"]
    assert set(capabilities["cannot"]) >= {"checkpoint", "migrate", "assist"} and "resume" not in capabilities["cannot"]
    assert capabilities["engine"] == {
        "kind": "vllm",
        "engine": "vLLM",
        "url": engine.address,
        "model": "Qwen3-32B",  # the probe found the engine serving the catalog's short name
    }
    status, answer = http_json(
        adapter.address + "/v1/completions",
        data={**body, "lifeline": {"holders": [{"name": "x", "address": "http://x:1"}]}},
        headers=AGENT_HEAD,
    )
    assert status == 501 and answer["error"]["param"] == "lifeline"

    engine.kill()
    wait_for(lambda: http_json(adapter.address + "/health")[0] == 503, 5, 0.1, "adapter notices the engine is gone")
    status, answer = http_json(adapter.address + "/v1/completions", data=body)
    assert status == 502 and "did not answer" in answer["error"]["message"]


async def test_a_request_resumed_by_re_prefill_continues_the_undisturbed_text(node_factory):
    engine = node_factory("vllm-r", "--time-scale", "0.05")
    adapter = node_factory("adapter-r", "--engine-url", engine.address, "--engine-kind", "vllm", env=ENV)
    wait_for(lambda: http_json(adapter.address + "/health")[0] == 200, 10, 0.1, "adapter sees the engine")
    for kind, path, base in (
        ("completion", "/v1/completions", {"prompt": "resume me exactly where I was"}),
        ("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "resume me"}]}),
    ):
        body = {"model": "Qwen3-32B", **base, "max_tokens": 30, "temperature": 0}
        whole = await sse_choices(adapter.address, path, {**body, "lifeline": {"return_token_ids": True}})
        ids = [i for c in whole[0] for i in c.get("token_ids", [])]
        assert len(ids) > 12, kind
        resumed, usage = await sse_choices(
            adapter.address,
            path,
            {**body, "lifeline": {"return_token_ids": True, "resume": {"generated_token_ids": ids[:11]}}},
            headers=AGENT_HEAD,
        )
        assert [i for c in resumed for i in c.get("token_ids", [])] == ids[11:], kind
        # The text of every token after the first is the undisturbed run's (the emulated engine spells an
        # output's first token capitalised, without a space: a real engine's text is checked in test_real_engine).
        assert [texts([c], kind) for c in resumed[1:]] == [texts([c], kind) for c in whole[0][12:]], kind
        assert usage["completion_tokens"] == len(ids)  # the whole request's, as the client counts it
    # The resume says how it was done.
    status, answer = http_json(
        adapter.address + "/v1/completions",
        data={**body_of("x"), "lifeline": {"resume": {"generated_token_ids": [5, 6]}}},
        headers=AGENT_HEAD,
    )
    assert status == 200 and answer["lifeline"]["resume"]["method"] == "re-prefill"


def body_of(prompt: str) -> dict:
    return {"model": "Qwen3-32B", "prompt": prompt, "max_tokens": 8, "temperature": 0}


def texts(choices: list[dict], kind: str) -> str:
    if kind == "chat":
        return "".join((c.get("delta") or {}).get("content") or "" for c in choices)
    return "".join(c.get("text") or "" for c in choices)


async def test_the_adapter_streams_the_engines_tokens_and_logprobs_through_the_one_agent(node_factory):
    engine = node_factory("stock-engine", "--time-scale", "0.05")
    adapter = node_factory("adapter-s", "--engine-url", engine.address)  # kind told by the engine's metrics
    wait_for(lambda: http_json(adapter.address + "/health")[0] == 200, 10, 0.1, "adapter sees the engine")
    body = {
        "model": "Qwen3-32B",
        "prompt": "stream me through",
        "max_tokens": 20,
        "temperature": 0,
        "logprobs": 2,
        "lifeline": {"return_token_ids": True},
    }
    direct, direct_usage = await sse_choices(engine.address, "/v1/completions", body)
    through, usage = await sse_choices(adapter.address, "/v1/completions", body)
    assert through == direct and usage == direct_usage
    assert len(through) == 21 and all(c["token_ids"] for c in through[:-1])

    chat = {
        "model": "Qwen3-32B",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 15,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 1,
    }
    direct, direct_usage = await sse_choices(engine.address, "/v1/chat/completions", chat)
    through, usage = await sse_choices(adapter.address, "/v1/chat/completions", chat)
    assert texts(through, "chat") == texts(direct, "chat") and usage == direct_usage
    assert [c["logprobs"]["content"][0]["logprob"] for c in through[:-1]] == [
        c["logprobs"]["content"][0]["logprob"] for c in direct[:-1]
    ]
    status, whole = http_json(adapter.address + "/v1/chat/completions", data=chat)
    assert status == 200 and whole["choices"][0]["message"]["content"] == texts(direct, "chat")

    metrics = urllib.request.urlopen(adapter.address + "/metrics").read().decode()
    assert 'vllm:time_to_first_token_seconds_count{model_name="Qwen3-32B",node="adapter-s"}' in metrics
    assert 'vllm:num_requests_running{model_name="Qwen3-32B",node="adapter-s"}' in metrics


def test_an_adapter_node_answers_501_for_each_capability_its_engine_lacks(node_factory):
    adapter = node_factory(
        "adapter-501",
        "--engine-url",
        "http://127.0.0.1:9",
        "--engine-kind",
        "vllm",
        "--enable-faults",
        env={**ENV, "LIFELINE_FAULT_TOKEN": "fault-token"},
    )
    capabilities = http_json(adapter.address + "/agent/capabilities")[1]
    assert capabilities["offers"] == ["openai", "events", "resume", "telemetry"]
    assert capabilities["cannot"] == {name: c.does for name, c in CAPABILITIES.items() if name != "resume"}
    for method, path, capability in [
        ("POST", "/agent/kv/batch", "checkpoint"),
        ("GET", "/agent/kv", "checkpoint"),
        ("POST", "/agent/requests/r-1/holders", "checkpoint"),
        ("POST", "/agent/requests/r-1/migrate", "migrate"),
        ("POST", "/agent/assist", "assist"),
        ("POST", "/agent/draft", "draft"),
        ("POST", "/agent/reload", "reload"),
        ("GET", "/agent/config", "config"),
        ("POST", "/agent/reset", "reset"),
        ("POST", "/agent/faults", "faults"),
    ]:
        status, answer = http_json(
            adapter.address + path, data={} if method == "POST" else None, method=method, headers=AGENT_HEAD
        )
        assert status == 501, (path, answer)
        error = answer["error"]
        assert error["type"] == "not_implemented" and set(error) == {"message", "type", "param", "code"}
        assert f"cannot {CAPABILITIES[capability].does}: it does not offer `{capability}`" in error["message"]
    body = {"model": "Qwen3-32B", "prompt": "x", "lifeline": {"checkpoint_prefill_chunks": True}}
    status, answer = http_json(adapter.address + "/v1/completions", data=body)
    assert status == 501 and "`checkpoint`" in answer["error"]["message"] and answer["error"]["param"] == "lifeline"


# --- an engine that does not answer as the adapter needs ------------------------------------------


def fake_vllm(chunks: list[dict | str], bodies: list[dict], *, models=("Qwen/Qwen3-32B",), metrics=True):
    """An engine with vLLM's API that streams the given chunks to every generation request."""

    async def stream(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for chunk in chunks:
            await response.write(f"data: {chunk if isinstance(chunk, str) else json.dumps(chunk)}\n\n".encode())
        return response

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"tokens": [7] * len(json.dumps(body.get("messages") or body.get("prompt")).split())})

    async def listing(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": m} for m in models]})

    async def exposition(request: web.Request) -> web.Response:
        text = "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n" if metrics else "python_info 1\n"
        return web.Response(text=text)

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_post("/v1/completions", stream)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/v1/models", listing)
    app.router.add_get("/metrics", exposition)
    app.router.add_get("/health", health)
    return app


@pytest.fixture
async def engine_at():
    """`await engine_at(app)`: the app served on a free port, and an adapter (vLLM dialect) in front of it."""
    runners, engines = [], []

    async def start(app: web.Application, kind: str = "vllm") -> AdapterEngine:
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = site._server.sockets[0].getsockname()[1]
        engine = AdapterEngine(
            f"http://127.0.0.1:{port}", catalog.Deployment.of("Qwen3-32B", "H100-SXM", 1), "adapter-unit", kind
        )
        engine.start()
        engines.append(engine)
        return engine

    yield start
    for engine in engines:
        await engine.stop()
    for runner in runners:
        await runner.cleanup()


def completion_chunk(text: str, ids: list[int] | None, finish: str | None = None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    return {"object": "text_completion", "choices": [choice]}


async def events_of(seq) -> tuple[list[TokenEvent], FinishEvent]:
    tokens = []
    while not isinstance(event := await asyncio.wait_for(seq.events.get(), 5), FinishEvent):
        tokens.append(event)
    return tokens, event


async def test_an_engine_that_does_not_say_its_token_ids_is_refused_with_what_to_set(engine_at):
    bodies: list[dict] = []
    engine = await engine_at(fake_vllm([completion_chunk("Hi", None, "length"), "[DONE]"], bodies))
    assert await engine.wait_ready(5)
    [problem] = await engine.probe()
    assert "did not say its tokens' ids" in problem and "vLLM 0.10.2 or newer" in problem
    [sent] = bodies
    assert sent["prompt"] == [7, 7] and sent["return_token_ids"] is True and "lifeline" not in sent


async def test_an_engine_serving_another_model_or_without_metrics_is_refused(engine_at):
    engine = await engine_at(fake_vllm([], [], models=("meta-llama/Llama-3-8B",), metrics=False))
    problems = await engine.probe()
    assert any("serves meta-llama/Llama-3-8B, not 'Qwen/Qwen3-32B'" in p and "--engine-model" in p for p in problems)
    assert any("no running series" in p and "--disable-log-stats" in p for p in problems)
    with pytest.raises(EngineMismatch, match="has no vllm:, sglang: or llamacpp: series"):
        auto = await engine_at(fake_vllm([], [], metrics=False), kind="auto")
        await auto.identify()


def test_a_node_in_front_of_a_mismatched_engine_never_registers(tmp_path):
    with served_in_a_thread(fake_vllm([], [], models=("other/model",))) as url:
        node = NodeProcess(
            "mismatched", "--engine-url", url, "--control-url", "http://127.0.0.1:9", log_dir=tmp_path
        ).start()
        assert node.proc.wait(timeout=20) == 3
        log = (tmp_path / "mismatched.log").read_text()
        assert "refusing to register" in log and "serves other/model, not 'Qwen/Qwen3-32B'" in log
        assert "control plane" not in log  # it never tried to register


@contextlib.contextmanager
def served_in_a_thread(app: web.Application):
    """`app` served on a free port by an event loop of its own in a thread (a node process can reach it)."""

    async def serve():
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, site._server.sockets[0].getsockname()[1]

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner, port = asyncio.run_coroutine_threadsafe(serve(), loop).result(5)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)


async def test_tokens_an_engine_sent_in_one_chunk_go_to_the_client_in_one(node_factory):
    """vLLM sends a busy step's tokens in one chunk, with one text for them all. Written one chunk per token (the
    text on the first), a stream cut between them and resumed by re-prefill repeated the text of the tokens after
    the cut: a CI run of the real vLLM (tests/recovery/gateway/test_vllm_engine.py) got " keeper hear netsmore"
    twice. The node writes them as the engine did, so every cut a gateway can make is at the engine's boundary."""
    chunks = [
        completion_chunk("A", [11]),
        completion_chunk(" busy step", [12, 13, 14]),
        completion_chunk(" ends", [15], "length"),
        "[DONE]",
    ]
    with served_in_a_thread(fake_vllm(chunks, [])) as url:
        node = node_factory("grouped", "--engine-url", url, "--engine-kind", "vllm", env=ENV)
        wait_for(lambda: http_json(node.address + "/health")[0] == 200, 20, 0.1, "the node passes its engine's probe")
        for path, base in (("/v1/completions", {"prompt": "p"}), ("/v1/chat/completions", {"messages": MESSAGES})):
            body = {"model": "Qwen3-32B", **base, "max_tokens": 5, "logprobs": None, "temperature": 0}
            got, usage = await sse_choices(node.address, path, {**body, "lifeline": {"return_token_ids": True}})
            kind = "chat" if "messages" in base else "completion"
            said = [(c["token_ids"], texts([c], kind)) for c in got if c.get("token_ids")]
            assert said == [([11], "A"), ([12, 13, 14], " busy step"), ([15], " ends")], path
            assert usage["completion_tokens"] == 5
            # Asked for logprobs, the chunk lists one for each of its tokens, as vLLM's does.
            asked = {"logprobs": 1} if kind == "completion" else {"logprobs": True, "top_logprobs": 1}
            got, _ = await sse_choices(node.address, path, {**body, **asked})
            key = "token_logprobs" if kind == "completion" else "content"
            listed = [c["logprobs"][key] for c in got if c["logprobs"]]
            assert [len(each) for each in listed] == [1, 3, 1], path


MESSAGES = [{"role": "user", "content": "hi"}]


async def test_an_engine_failing_mid_stream_ends_the_request_with_an_error(engine_at):
    engine = await engine_at(
        fake_vllm(
            [
                completion_chunk("partial", [11]),
                {"error": {"message": "CUDA error: an illegal memory access", "type": "InternalServerError"}},
            ],
            [],
        )
    )
    seq = await engine.submit_request(parse({"model": "Qwen3-32B", "prompt": "fail me", "max_tokens": 8}, "completion"))
    tokens, finish = await events_of(seq)
    assert [(t.token_id, t.text) for t in tokens] == [(11, "partial")]
    assert finish.reason == "error" and "illegal memory access" in finish.detail["reason"]
    assert engine.counters["engine_errors"] == 1 and engine.forwarded == {}


# --- an engine the node restarts (reload, GPU reset) ----------------------------------------------


class RestartedInProcess:
    """Where the node's EngineProcess would be: a restart takes the fake engine down and brings a fresh one up on
    the same port `delay_s` later (a real engine listens a while after it starts). The fresh engine's /v1/models
    answers 503 to its first `unlisted` requests (its listing not up yet, though /health answers)."""

    can_reset = False
    exits_unanswered = 0

    def __init__(self, delay_s: float, unlisted: int = 0):
        self.delay_s, self.unlisted = delay_s, unlisted
        self.port = 0
        self.runner: web.AppRunner | None = None
        self.listings: list[int] = []  # each /v1/models request to the engine started last: the status it got
        self._coming: asyncio.Task | None = None

    def app(self, unlisted: int) -> web.Application:
        app = fake_vllm([completion_chunk("Hi", [11], "length"), "[DONE]"], [])
        listing = next(r for r in app.router.routes() if r.method == "GET" and r.resource.canonical == "/v1/models")
        answer = listing.handler
        self.listings = []

        async def flaky(request: web.Request) -> web.Response:
            status = 503 if len(self.listings) < unlisted else 200
            self.listings.append(status)
            return web.Response(status=503) if status == 503 else await answer(request)

        replaced = web.Application()
        for route in app.router.routes():
            replaced.router.add_route(
                route.method, route.resource.canonical, flaky if route is listing else route.handler
            )
        return replaced

    async def up(self, unlisted: int = 0) -> None:
        self.runner = web.AppRunner(self.app(unlisted))
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def restart(self, reset: bool = False) -> bool:
        await self.stop()

        async def later() -> None:
            await asyncio.sleep(self.delay_s)
            await self.up(self.unlisted)

        self._coming = asyncio.get_running_loop().create_task(later())
        return True

    def answered(self) -> None:
        pass

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    def describe(self) -> dict:
        return {}


async def _reloaded(
    delay_s: float, unlisted: int = 0, stale_poll: bool = False
) -> tuple[AdapterEngine, RestartedInProcess]:
    """An adapter over a RestartedInProcess engine, serving, then reloaded; returned once it serves again."""
    fake = RestartedInProcess(delay_s, unlisted)
    await fake.up()
    deployment = catalog.Deployment.of("Qwen3-32B", "H100-SXM", 1)
    engine = AdapterEngine(f"http://127.0.0.1:{fake.port}", deployment, "adapter-unit", "vllm", process=fake)
    engine.start()
    try:
        assert await engine.wait_ready(5) and await engine.probe() == []
        async with asyncio.timeout(5):
            while engine.model_state != "serving":
                await asyncio.sleep(0.02)
        engine.reload()
        if stale_poll:
            engine.engine_ready = True  # a poll of the old engine answered between the reload's request and the stop
        async with asyncio.timeout(10 + delay_s):
            while engine.model_state != "serving":
                await asyncio.sleep(0.02)
    except BaseException:
        await engine.stop()
        raise
    return engine, fake


async def test_a_reloaded_engine_is_probed_once_it_answers_not_on_a_poll_of_the_one_before(caplog):
    """CI caught it: a node's llama-server reloaded and never served again. A /health poll of the old engine that
    landed between the reload's request and the stop left `engine_ready` set, so the new engine was probed before
    it listened, refused, and never probed again."""
    engine, fake = await _reloaded(delay_s=0.5, stale_poll=True)
    try:
        assert fake.listings == [200]  # probed once, after the fresh engine answered /health
        assert "not serving yet" not in caplog.text  # and never before it listened
        assert engine.verified
    finally:
        await engine.stop()


async def test_a_restarted_engine_that_fails_its_first_probes_is_probed_again_until_it_serves():
    engine, fake = await _reloaded(delay_s=0.2, unlisted=2)
    try:
        assert fake.listings == [503, 503, 200]  # refused twice, then serving: never given up on for a moment's 503
    finally:
        await engine.stop()


async def test_relaying_an_engines_burst_gives_the_agents_loop_a_turn_every_few_events():
    """An engine faster than its relay (vLLM's CPU build on the tiny model: ~350 tokens/s) leaves a whole reply in
    the agent's buffer. Read without a turn of the loop, the agent answered no status, health probe or heartbeat
    for 3-5 s while it relayed one reply."""
    body = b"".join(b'data: {"n": %d}\n\n' % i for i in range(600)) + b"data: [DONE]\n\n"
    async with buffered_burst(body) as response:
        longest, count = await longest_hold_of_the_loop(_events(response))
    assert count == 601 and longest <= YIELD_EVERY, longest
