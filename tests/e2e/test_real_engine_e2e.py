"""A real engine joins the whole system (issue 10), end to end: `manage.py demo` with emulated nodes, and a
llama.cpp server with the node agent beside it as a sidecar. The sidecar registers once its engine answers as it
must; the control plane canaries it against a golden run recorded from it, routes the official client's requests
to it beside the emulated nodes, and tells a silent corruption (the engine restarted on other weights) from a
healthy engine."""

import openai
import pytest

from harness.real_engine import LlamaServer, tiny_model
from tests.helpers import NodeProcess, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.adds_nodes]

MODEL = "Tiny-Llama"
SERVED_AS = "lifeline/tiny-llama"


def row(stack, name: str) -> dict:
    """The node's row on the cluster page's API, {} while it is not there yet."""
    status, body = stack.api("/api/cluster")
    assert status == 200, body
    return next((n for n in body["nodes"] if n["name"] == name), {})


def canaries(stack, name: str) -> list[dict]:
    status, body = stack.api(f"/api/nodes/{name}/health")
    assert status == 200, body
    return body["canaries"]


def test_real_engines_register_are_canaried_and_serve_beside_emulated_nodes(demo_stack, tmp_path):
    stack = demo_stack  # the whole system with 3 emulated nodes (tests/conftest.py)
    info = stack.info
    env = {"LIFELINE_NODE_TOKEN": info["node_token"], "LIFELINE_AGENT_TOKEN": info["agent_token"]}
    control = info["urls"]["console"].rstrip("/")
    model = tiny_model(tmp_path / "tiny.gguf", seed=0)
    servers = [LlamaServer(model, alias=SERVED_AS, log_path=tmp_path / f"l{i}.log").start() for i in (1, 2)]
    nodes = [
        NodeProcess(
            f"real-{i}",
            *("--engine-url", server.url, "--model", MODEL, "--rack", f"rack-{'ab'[i - 1]}", "--control-url", control),
            env=env,
            log_dir=tmp_path,
        )
        for i, server in zip((1, 2), servers)
    ]
    try:
        for node in nodes:
            node.start()
        for name in ("real-1", "real-2"):
            wait_for(lambda n=name: row(stack, n).get("state") == "serving", 60, 0.5, f"{name} in service")
            node = row(stack, name)
            assert node["engine"] == "llamacpp" and node["model"] == MODEL and node["health"] == "healthy"

        # Canaries run against them: the two agree, so their answers become the golden run; later ones pass it.
        def judged(name):
            return [c for c in canaries(stack, name) if c["passed"] and "no golden run" not in c["detail"]]

        assert wait_for(lambda: judged("real-1") and judged("real-2"), 90, 0.5, "canaries judged by a golden run")

        # The official client, through the gateway: the real engines' model and the emulated one, side by side.
        client = openai.OpenAI(base_url=info["urls"]["gateway"], api_key=info["gateway_key"], max_retries=0)
        real = client.completions.with_raw_response.create(model=MODEL, prompt="The fleet", max_tokens=24)
        assert real.headers["x-lifeline-node"] in ("real-1", "real-2")
        assert real.parse().usage.completion_tokens == 24
        emulated = client.chat.completions.with_raw_response.create(
            model="Qwen3-32B", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert emulated.headers["x-lifeline-node"].startswith("node-")
        assert {m.id for m in client.models.list()} >= {MODEL, "Qwen3-32B"}

        # real-2's engine comes back on other weights (its sidecar lives on): what silent corruption looks like
        # from outside. Its canaries no longer match the golden run, and it is taken out of routing.
        port = servers[1].port
        servers[1].stop()
        other = tiny_model(tmp_path / "other.gguf", seed=3)
        servers[1] = LlamaServer(other, alias=SERVED_AS, log_path=tmp_path / "other.log").start(port=port)
        assert wait_for(
            lambda: [c for c in canaries(stack, "real-2") if c["kind"] == "token_mismatch"], 90, 0.5, "a mismatch"
        )
        wait_for(lambda: row(stack, "real-2")["weight"] == 0, 60, 0.5, "real-2 out of routing")
        assert row(stack, "real-1")["weight"] > 0
    finally:
        for node in nodes:
            node.stop()
        for server in servers:
            server.stop()
