"""The OpenAI surface users' tools send (issue 16, item 4).

Outside clients send more than our own tests do: `n`, `stop` lists, `logprobs`
with `top_logprobs`, `seed`, `stream_options.include_usage` (aiperf and most
benchmark tools read `usage` from the last chunk), `tools` and `tool_choice`,
`response_format`, `user`, prompts longer than the context, empty message
lists. Each is sent here through the official `openai` client, streaming and
not, to the gateway and to a node directly: it is served as vLLM's OpenAI
server serves it, or refused with a 400 that names the field; never a 500, a
hang or a field dropped in silence, and the gateway's answer is the node's.
"""

import asyncio
import urllib.request

import openai
import pytest

from tests.gateway_cluster import KEY, gw
from workers import catalog

MODEL = "Qwen3-32B"
ASK = [{"role": "user", "content": "Which rack of the fleet runs hot tonight, and why?"}]
NODE_CONTEXT = catalog.Deployment.of(MODEL, "H100-SXM", 1).max_context_tokens  # what the test nodes' KV caches hold
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "drain_node",
            "description": "Cordon a node and move its requests off it.",
            "parameters": {"type": "object", "properties": {"node": {"type": "string"}}, "required": ["node"]},
        },
    }
]
TARGETS = ("gateway", "node")


async def _fleet(cluster, prefix: str) -> tuple[str, dict[str, openai.AsyncOpenAI]]:
    """Two nodes and a gateway; a client for the gateway and one for the first node, as a user would point one."""
    cluster.start_nodes(f"{prefix}-a", f"{prefix}-b")
    base = await cluster.gateway()
    node = cluster.nodes[f"{prefix}-a"].address
    clients = {
        "gateway": openai.AsyncOpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=60),
        "node": openai.AsyncOpenAI(base_url=node + "/v1", api_key="unused", max_retries=0, timeout=60),
    }
    return base, clients


def _server_errors(base: str) -> list[str]:
    text = urllib.request.urlopen(base + "/metrics").read().decode()
    return [
        line
        for line in text.splitlines()
        if line.startswith("lifeline_gateway_requests_total{") and 'code="5' in line and not line.endswith(" 0.0")
    ]


async def _settled(base: str) -> None:
    """The gateway answered everything without a server error and holds nothing for any of it."""
    health = (await gw(base + "/healthz"))[1]
    assert health["in_flight"] == 0 and health["lost"] == [], health
    assert await asyncio.to_thread(_server_errors, base) == []


async def _chat(client: openai.AsyncOpenAI, **request):
    return await client.chat.completions.create(**{"model": MODEL, "messages": ASK, **request})


async def _streamed(client: openai.AsyncOpenAI, kind: str = "chat", **request) -> list:
    """Every chunk of a streamed answer, as the client's own iterator parses them."""
    if kind == "chat":
        stream = await client.chat.completions.create(**{"model": MODEL, "messages": ASK, "stream": True, **request})
    else:
        stream = await client.completions.create(**{"model": MODEL, "stream": True, **request})
    return [chunk async for chunk in stream]


def _text(chunks: list) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def _finish(chunks: list) -> str | None:
    return next((c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason), None)


async def _refused(client: openai.AsyncOpenAI, param: str, code: str | None = None, **request) -> str:
    """The request is refused 400 naming `param`, streaming or not; returns the message."""
    messages = []
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as excinfo:
            await client.chat.completions.create(**{"model": MODEL, "messages": ASK, "stream": stream, **request})
        error = excinfo.value
        assert error.status_code == 400 and error.param == param, (param, error.body)
        assert error.code == code, error.body
        if code != "context_length_exceeded":  # vLLM's words for that one, which say "prompt"
            assert param in error.message, error.body
        messages.append(error.message)
    return messages[0]


# --- served -----------------------------------------------------------------------------------------------------
async def test_stop_lists_logprobs_seed_n_and_user_are_served_as_vllm_serves_them(cluster):
    base, clients = await _fleet(cluster, "sv")
    greedy = {"temperature": 0, "max_tokens": 16, "extra_body": {"ignore_eos": True}}
    answers = {target: await _chat(client, **greedy) for target, client in clients.items()}
    text = answers["node"].choices[0].message.content
    assert answers["gateway"].choices[0].message.content == text and len(text.split()) >= 8

    # stop=["a", "b"]: the text ends where the first of either begins, the stop string left out, finish "stop"; a
    # stop string that spans two tokens is cut whole, never half-streamed (vLLM holds back what may begin one).
    words = text.split()
    for stops in ([words[6], words[3]], ["never in this text", words[4]], [f"{words[4]} {words[5]}"]):
        cut = min(text.find(s) for s in stops if s in text)
        for target, client in clients.items():
            answer = await _chat(client, stop=stops, **greedy)
            assert answer.choices[0].message.content == text[:cut], (target, stops)
            assert answer.choices[0].finish_reason == "stop", target
            chunks = await _streamed(client, stop=stops, **greedy)
            assert _text(chunks) == text[:cut] and _finish(chunks) == "stop", (target, stops)

    # logprobs with top_logprobs=3: three alternatives for every token, the greedy pick first; streamed alike.
    seen = {}
    for target, client in clients.items():
        answer = await _chat(client, logprobs=True, top_logprobs=3, temperature=0, max_tokens=5)
        content = answer.choices[0].logprobs.content
        assert len(content) == answer.usage.completion_tokens == 5, target
        for token in content:
            assert len(token.top_logprobs) == 3 and token.logprob <= 0, target
            assert (token.top_logprobs[0].token, token.top_logprobs[0].logprob) == (token.token, token.logprob)
            assert token.bytes == list(token.token.encode())
        # Each token's string is the text it adds: joined, they are the answer ("Evening." not "evening" ".").
        assert "".join(t.token for t in content) == answer.choices[0].message.content, target
        chunks = await _streamed(client, logprobs=True, top_logprobs=3, temperature=0, max_tokens=5)
        streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
        assert [t.model_dump() for t in streamed] == [t.model_dump() for t in content], target
        seen[target] = [t.model_dump() for t in content]
        # logprobs alone: each token's own logprob, no alternatives.
        answer = await _chat(client, logprobs=True, temperature=0, max_tokens=3)
        assert [(len(t.top_logprobs), t.logprob <= 0) for t in answer.choices[0].logprobs.content] == [(0, True)] * 3
    assert seen["gateway"] == seen["node"]

    # seed: a sampled answer is repeatable, whichever node serves it, streamed or not; another seed draws another.
    sampled = {"temperature": 1.0, "max_tokens": 12}
    by_seed = {}
    for seed in (11, 12, 13):
        texts = set()
        for client in clients.values():
            texts.add((await _chat(client, seed=seed, **sampled)).choices[0].message.content)
            texts.add((await _chat(client, seed=seed, **sampled)).choices[0].message.content)
            texts.add(_text(await _streamed(client, seed=seed, **sampled)))
        assert len(texts) == 1, (seed, texts)
        by_seed[seed] = texts.pop()
    assert len(set(by_seed.values())) > 1, by_seed

    # n: one choice is served; more than one is refused naming n (this engine draws one sequence per request).
    # user: accepted, and changes nothing.
    for target, client in clients.items():
        answer = await _chat(client, n=1, user="oncall-7", **greedy)
        assert len(answer.choices) == 1 and answer.choices[0].message.content == text, target
        assert "n=1" in await _refused(client, "n", "unsupported_parameter", n=2, max_tokens=4)
    await _settled(base)


async def test_include_usage_puts_usage_in_a_final_chunk_with_no_choices(cluster):
    """As OpenAI does: every chunk carries usage null but the last, whose choices are empty and whose counts are the
    tokens streamed (what aiperf and other benchmark tools read)."""
    base, clients = await _fleet(cluster, "us")
    for target, client in clients.items():
        whole = await _chat(client, temperature=0, max_tokens=9)
        for kind, request in (
            ("chat", {"temperature": 0, "max_tokens": 9}),
            ("chat", {"temperature": 0.7, "seed": 5, "max_tokens": 9, "stop": ["zq-never-said"]}),
            ("completion", {"prompt": "The hottest rack tonight is", "max_tokens": 7}),
        ):
            chunks = await _streamed(client, kind, stream_options={"include_usage": True}, **request)
            *tokens, last = chunks
            assert last.choices == [] and last.usage is not None, (target, kind, last)
            assert all(c.usage is None and c.choices for c in tokens), (target, kind)
            streamed = [c for c in tokens if c.choices[0].finish_reason is None]  # one chunk per token
            assert 0 < last.usage.completion_tokens == len(streamed) <= request["max_tokens"], (target, kind)
            assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
            if kind == "chat":
                assert last.usage.prompt_tokens == whole.usage.prompt_tokens, target
                assert last.object == "chat.completion.chunk" and last.id == tokens[0].id
            # Without the option, no chunk carries usage.
            plain = await _streamed(client, kind, **request)
            assert all(c.usage is None and c.choices for c in plain) and len(plain) == len(tokens), (target, kind)
    await _settled(base)


async def test_tools_with_auto_or_none_and_a_text_response_format_are_served(cluster):
    base, clients = await _fleet(cluster, "tl")
    answers = {}
    for target, client in clients.items():
        # The model reads the tools it is offered: they are in the prompt, as a chat template writes them.
        bare = await _chat(client, temperature=0, max_tokens=2)
        offered = await _chat(client, temperature=0, max_tokens=2, tools=TOOLS, tool_choice="auto")
        assert offered.usage.prompt_tokens > bare.usage.prompt_tokens + 20, target
        answers.setdefault(target, []).append(offered.usage.prompt_tokens)
        for request in (
            {"tools": TOOLS, "tool_choice": "auto"},
            {"tools": TOOLS, "tool_choice": "none"},
            {"tools": TOOLS, "parallel_tool_calls": False},
            {"response_format": {"type": "text"}},
        ):
            answer = await _chat(client, temperature=0, max_tokens=6, **request)
            message = answer.choices[0].message
            assert message.content and message.tool_calls is None, (target, request)
            assert answer.choices[0].finish_reason in ("stop", "length"), (target, request)
            chunks = await _streamed(client, temperature=0, max_tokens=6, **request)
            assert _text(chunks) == message.content, (target, request)
            answers.setdefault(target, []).append(message.content)
    assert answers["gateway"] == answers["node"]
    await _settled(base)


# --- refused ---------------------------------------------------------------------------------------------------
async def test_what_cannot_be_served_is_refused_400_naming_the_field(cluster):
    base, clients = await _fleet(cluster, "rf")
    for target, client in clients.items():
        await _refused(client, "messages", messages=[])
        await _refused(client, "n", "unsupported_parameter", n=3)
        await _refused(client, "tool_choice", "unsupported_parameter", tools=TOOLS, tool_choice="required")
        await _refused(
            client,
            "tool_choice",
            "unsupported_parameter",
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "drain_node"}},
        )
        await _refused(client, "response_format", "unsupported_parameter", response_format={"type": "json_object"})
        await _refused(
            client,
            "response_format",
            "unsupported_parameter",
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "rack", "schema": {"type": "object", "properties": {"rack": {}}}},
            },
        )
        # Longer than the context: vLLM's answer, with OpenAI's code; a prompt that fits but leaves no room for an
        # explicit max_tokens is refused naming max_tokens.
        long_ask = [{"role": "user", "content": "word " * (NODE_CONTEXT + 10)}]
        message = await _refused(client, "messages", "context_length_exceeded", messages=long_ask)
        assert f"maximum context length is {NODE_CONTEXT} tokens" in message, target
        fits = [{"role": "user", "content": "word " * (NODE_CONTEXT - 200)}]
        await _refused(client, "max_tokens", "context_length_exceeded", messages=fits, max_tokens=500)
    await _settled(base)
