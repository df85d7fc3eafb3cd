"""The node protocol, fuzzed against a real node process: checkpoint pages and commit records (`/agent/kv/batch`)
malformed, truncated, reordered and replayed; resume requests (`lifeline.resume` on the OpenAI endpoints) malformed;
and schemathesis over the control endpoints (console/openapi.py's node document) with the agent token.

Never a server error, never a hang (every call has a deadline), every refusal a 4xx that names the field; and what the
holder keeps of a request is always a prefix of the pages its serving node sent, in order, each with its own digest.
"""

import json
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

from tests.helpers import NodeProcess, examples, wait_for
from workers import catalog
from workers.catalog import BLOCK_TOKENS
from workers.checkpoint import make_page

AGENT_TOKEN = "fuzz-agent-token"
MODEL = "Qwen3-32B"
WIRE_SCALE = 1 / 4096  # the node's default --kv-wire-scale
EXAMPLES = examples(100)
DEADLINE_S = 10  # a call that takes longer is a hang
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    process = NodeProcess(
        "fuzz-holder",
        "--time-scale",
        "0.02",
        env={"LIFELINE_AGENT_TOKEN": AGENT_TOKEN, "LIFELINE_NODE_TOKEN": ""},
        log_dir=tmp_path_factory.mktemp("fuzz-node"),
    ).start()
    yield process
    process.stop()


def call(node, method: str, path: str, body=None, *, raw: bytes | None = None, token: str = AGENT_TOKEN):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(
        node.address + path,
        data=data,
        method=method,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=DEADLINE_S) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def assert_answer_is_sound(status: int, text: bytes) -> dict | None:
    """No server error; a refusal is JSON in OpenAI's shape that names the field at fault."""
    assert status < 500, (status, text[:400])
    if status >= 400:
        answer = json.loads(text)
        error = answer["error"]
        assert error["message"], answer
        if status == 400:
            assert error.get("param"), answer
        return answer
    return json.loads(text) if text else None


def pages_of(request_id: str, blocks: int) -> list[dict]:
    """A serving node's pages for `request_id`, as CheckpointStreamer sends them: seq from 1, block from 0."""
    model = catalog.model(MODEL)
    return [
        make_page(
            request_id, block, [(block * BLOCK_TOKENS + i) * 7 % 1000 for i in range(BLOCK_TOKENS)], model, WIRE_SCALE
        ).to_wire(request_id, block + 1)
        for block in range(blocks)
    ]


def held(node, request_id: str) -> dict | None:
    status, text = call(node, "GET", f"/agent/kv/{request_id}")
    assert status in (200, 404), (status, text[:200])
    return json.loads(text) if status == 200 else None


# --- what a sender may get wrong with a page -------------------------------------------------------------------
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
FIELDS = ("request_id", "seq", "block", "tokens", "nbytes", "payload", "digest")


@st.composite
def damaged_page(draw, page: dict) -> dict:
    page = dict(page)
    how = draw(st.sampled_from(["drop_field", "junk_field", "truncate_payload", "truncate_tokens", "flip_digest"]))
    key = draw(st.sampled_from(FIELDS))
    if how == "drop_field":
        page.pop(key)
    elif how == "junk_field":
        page[key] = draw(JUNK)
    elif how == "truncate_payload":
        page["payload"] = page["payload"][: draw(st.integers(0, len(page["payload"]) - 1))]
    elif how == "truncate_tokens":
        page["tokens"] = page["tokens"][: draw(st.integers(0, BLOCK_TOKENS - 1))]
    else:
        page["digest"] = page["digest"][::-1]
    return page


@st.composite
def page_streams(draw):
    """A request's pages as a flaky link and a buggy sender deliver them: some damaged, reordered, replayed, split
    into batches, with commit records that may run ahead of the pages or be malformed themselves."""
    request_id = f"fz-{draw(st.integers(0, 10**6))}"
    sent = pages_of(request_id, draw(st.integers(1, 6)))
    stream = []
    for page in sent:
        copies = draw(st.integers(0, 2))  # lost, delivered, or replayed
        for _ in range(copies):
            stream.append(draw(damaged_page(page)) if draw(st.integers(0, 4)) == 0 else page)
    stream = draw(st.permutations(stream)) if draw(st.booleans()) else stream
    cuts = sorted(draw(st.lists(st.integers(0, len(stream)), max_size=3)))
    batches = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    commits = []
    for _ in batches:
        if draw(st.booleans()):
            commit = {"request_id": request_id, "seq": draw(st.integers(0, 8)), "tokens": draw(st.integers(0, 200))}
            if draw(st.integers(0, 3)) == 0:
                commit[draw(st.sampled_from(["request_id", "seq", "tokens"]))] = draw(JUNK)
            commits.append([commit])
        else:
            commits.append([])
    return request_id, sent, batches, commits


@FUZZ
@given(stream=page_streams())
def test_pages_malformed_truncated_reordered_and_replayed_leave_a_verified_prefix(node, stream):
    request_id, sent, batches, commits = stream
    for pages, commit in zip(batches, commits, strict=True):
        body = {"source": "fz-sender", "model": MODEL, "pages": pages, "commits": commit}
        answer = assert_answer_is_sound(*call(node, "POST", "/agent/kv/batch", body))
        if "error" in (answer or {}):
            continue  # the whole batch refused, naming its field: nothing of it was taken
        for refusal in answer["refused"]:
            assert refusal["reason"] in ("digest", "order", "budget", "malformed"), refusal
            if refusal["reason"] == "malformed":
                assert refusal["field"].startswith("pages["), refusal
    kept = held(node, request_id)
    if kept is not None:
        # The holder keeps a prefix of what was sent, in order, every page its own: never a damaged or foreign one.
        assert kept["pages"] == sent[: len(kept["pages"])]
        assert 0 <= kept["committed_tokens"] <= len(kept["pages"]) * BLOCK_TOKENS
    call(node, "DELETE", f"/agent/kv/{request_id}")


BODY = st.recursive(
    JUNK,
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=8,
)


@FUZZ
@given(
    body=st.one_of(
        BODY,
        st.fixed_dictionaries(
            {"model": st.just(MODEL)},
            optional={"pages": BODY, "commits": BODY, "drops": BODY, "source": BODY, "direct": BODY},
        ),
    )
)
def test_any_json_body_to_the_batch_endpoint_is_answered_or_refused_by_field(node, body):
    answer = assert_answer_is_sound(*call(node, "POST", "/agent/kv/batch", body))
    if answer and "error" not in answer:
        assert set(answer) == {"accepted", "refused", "committed"}


@FUZZ
@given(raw=st.one_of(st.binary(max_size=64), st.text(max_size=64).map(str.encode)))
def test_bytes_that_are_not_json_are_refused_naming_the_body(node, raw):
    status, text = call(node, "POST", "/agent/kv/batch", raw=raw)
    assert_answer_is_sound(status, text)


# --- resume requests -------------------------------------------------------------------------------------------
@st.composite
def resumes(draw, address: str):
    peer = st.fixed_dictionaries(
        {"name": st.sampled_from(["fuzz-holder", "gone"]), "address": st.sampled_from([address, "http://127.0.0.1:9"])}
    )
    resume = st.fixed_dictionaries(
        {},
        optional={
            "generated_token_ids": st.one_of(st.lists(st.integers(-5, 2**40), max_size=20), BODY),
            "sources": st.one_of(st.lists(st.one_of(peer, BODY), max_size=2), BODY),
        },
    )
    extension = st.fixed_dictionaries(
        {"resume": st.one_of(resume, BODY)},
        optional={"request_id": st.one_of(st.just("fz-resume-1"), BODY), "attach": BODY, "holders": BODY},
    )
    return {
        "model": MODEL,
        "prompt": draw(st.sampled_from(["resume after a failure", "", "x" * 40])),
        "max_tokens": draw(st.integers(1, 8)),
        "temperature": 0,
        "stream": draw(st.booleans()),
        "lifeline": draw(extension),
    }


def test_resume_requests_malformed_or_from_holders_that_are_gone_never_fail_the_node(node):
    @FUZZ
    @given(body=resumes(node.address))
    def run(body):
        for path in ("/v1/completions",):
            status, text = call(node, "POST", path, body)
            if status == 200 and body["stream"]:
                assert text.rstrip().endswith(b"data: [DONE]"), text[-200:]
                continue
            assert_answer_is_sound(status, text)

    run()


# --- schemathesis over the control endpoints -------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_the_control_endpoints_fuzzed_with_the_agent_token_answer_no_server_error(node, mode):
    import schemathesis
    from schemathesis import GenerationMode
    from schemathesis.checks import content_type_conformance, not_a_server_error, status_code_conformance

    from console import openapi

    schema = schemathesis.openapi.from_dict(openapi.surface("node"))
    generation = GenerationMode.POSITIVE if mode == "positive" else GenerationMode.NEGATIVE
    seen: list[int] = []
    for result in schema.get_all_operations():
        operation = result.ok()

        @settings(FUZZ, max_examples=8)
        @given(case=operation.as_strategy(generation))
        def run(case):
            response = case.call(
                base_url=node.address, headers={"Authorization": f"Bearer {AGENT_TOKEN}"}, timeout=DEADLINE_S
            )
            seen.append(response.status_code)
            case.validate_response(
                response, checks=[not_a_server_error, status_code_conformance, content_type_conformance]
            )
            assert_answer_is_sound(response.status_code, response.content)

        run()
    assert seen and all(code < 500 for code in seen)
    # The node lives on: after the resets and reloads the fuzz asked for, its model loads and it serves again.
    wait_for(lambda: call(node, "GET", "/health")[0] == 200, timeout_s=60, message="the node serving again")


# --- the OpenAI-compatible surface, with Lifeline's own document, through the gateway and on a node ---------------
def _served_surface() -> dict:
    """console/openapi.py's gateway document as a live fleet can be fuzzed with: the model pinned to the one it serves,
    max_tokens capped, and no `lifeline` object (its holders would be addresses off this machine; the tests above
    fuzz it against the node with loopback ones)."""
    from console import openapi

    doc = openapi.surface("gateway")
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        schema = doc["components"]["schemas"][name]
        schema["properties"].pop("lifeline")
        schema["properties"]["model"] = {"type": "string", "enum": [MODEL]}
        schema["properties"]["max_tokens"] = {"type": "integer", "minimum": 1, "maximum": 16}
        schema["properties"].pop("max_completion_tokens", None)
        schema["required"] = [*schema["required"], "max_tokens"]
        schema["additionalProperties"] = False
    return doc


def _fuzz_surface(base_url: str, headers: dict, mode) -> list[int]:
    import schemathesis
    from schemathesis.checks import content_type_conformance, not_a_server_error, status_code_conformance

    schema = schemathesis.openapi.from_dict(_served_surface())
    seen: list[int] = []
    for result in schema.get_all_operations():

        @settings(FUZZ, max_examples=15)
        @given(case=result.ok().as_strategy(mode))
        def run(case):
            response = case.call(base_url=base_url, headers=headers, timeout=DEADLINE_S)
            seen.append(response.status_code)
            case.validate_response(
                response, checks=[not_a_server_error, status_code_conformance, content_type_conformance]
            )
            if response.status_code >= 400:
                assert_answer_is_sound(response.status_code, response.content)

        try:
            run()
        except Unsatisfiable:  # negative data for an operation that takes none (GET /v1/models)
            assert mode.name == "NEGATIVE" and "requestBody" not in str(result.ok().definition.raw)
    return seen


async def test_the_gateway_and_a_node_fuzzed_with_lifelines_own_openai_document(cluster):
    import asyncio

    from schemathesis import GenerationMode

    from tests.gateway_cluster import KEY

    cluster.start_nodes("oa-fz", extra=("--time-scale", "0.05"))
    base = await cluster.gateway()
    node = cluster.nodes["oa-fz"].address
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        seen = await asyncio.to_thread(_fuzz_surface, base, {"Authorization": f"Bearer {KEY}"}, mode)
        assert seen and all(code < 500 for code in seen)
        if mode == GenerationMode.POSITIVE:
            assert 200 in seen  # past the key and the checks, to the engines
        seen = await asyncio.to_thread(_fuzz_surface, node, {}, mode)
        assert seen and all(code < 500 for code in seen)


# --- every message of workers/protocol.py: parsed, or refused with the field named ---------------------------------
@st.composite
def near_valid(draw, valid: dict):
    """A valid message with some of its fields dropped or replaced by junk, and perhaps a field it does not have."""
    message = dict(valid)
    for key in draw(st.lists(st.sampled_from(sorted(valid)), min_size=1, max_size=2, unique=True)):
        how = draw(st.sampled_from(["drop", "junk", "nested"]))
        if how == "drop":
            message.pop(key)
        else:
            message[key] = draw(JUNK if how == "junk" else BODY)
    if draw(st.booleans()):
        message[draw(st.text(max_size=6))] = draw(BODY)
    return message


REGISTRATION = {
    "name": "fz-reg",
    "session": "0123456789abcdef",
    "address": "http://127.0.0.1:8201",
    "rack": "rack-a",
    "model": MODEL,
    "gpu": "H100-SXM",
    "tp": 1,
    "gpus": [{"index": 0, "uuid": "GPU-0", "name": "NVIDIA H100", "memory_bytes": 80 * 10**9}],
    "pid": 1,
    "host": "h",
    "version": 1,
}
HEARTBEAT = {
    "session": "0123456789abcdef",
    "model_state": "serving",
    "load": {"running": 1, "waiting": 0},
    "checkpoints": {"fz-a": {"bytes": 1, "requests": 1}},
    "xids": [{"at": 1.0, "gpu": 0, "code": 79}],
    "gpus": [{"index": 0, "lost": False, "utilization_pct": 50}],
}
BATCH = {"model": MODEL, "source": "fz-a", "direct": False, "pages": [], "commits": [], "drops": []}


@pytest.mark.parametrize("name", ["Registration", "Heartbeat", "KvBatch"])
def test_every_protocol_message_malformed_is_parsed_or_refused_naming_its_field(name):
    from workers import protocol

    parse = getattr(protocol, name).parse
    valid = {"Registration": REGISTRATION, "Heartbeat": HEARTBEAT, "KvBatch": BATCH}[name]
    parse(valid)

    @settings(FUZZ, max_examples=examples(200))
    @given(message=st.one_of(near_valid(valid), BODY))
    def run(message):
        try:
            parse(message)
        except protocol.ProtocolError as exc:
            assert exc.field and str(exc).startswith(exc.field), exc

    run()


def test_draft_requests_are_drafted_or_refused_naming_the_field():
    """A draft-ready node's /agent/draft: what it accepts it drafts (no server error from a sequence it took), what it
    cannot draft from is refused by field."""
    from workers.control_api import _draft_items_refusal
    from workers.engine import propose_drafts

    item = st.fixed_dictionaries(
        {"state": st.one_of(st.binary(min_size=1, max_size=16).map(bytes.hex), JUNK), "position": JUNK},
        optional={key: JUNK for key in ("temperature", "seed", "top_p", "top_k", "min_p", "min_tokens")},
    )

    @settings(FUZZ, max_examples=examples(200))
    @given(items=st.one_of(st.lists(st.one_of(item, JUNK), max_size=3), BODY))
    def run(items):
        refusal = _draft_items_refusal(items)
        if refusal is None:
            assert len(propose_drafts(MODEL, 2, items)) == len(items)
        else:
            assert refusal[0].startswith("items"), refusal

    run()
