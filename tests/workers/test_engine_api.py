"""The one engine interface: both engines implement it, and the one agent serves any engine that does."""

import asyncio
import json
import time

from aiohttp.test_utils import TestClient, TestServer

from tests.workers.test_engine import reference
from workers import catalog, tokens
from workers.adapter import AdapterEngine
from workers.agent import build_app
from workers.checkpoint import CheckpointStreamer
from workers.engine import Engine
from workers.engine_api import CAPABILITIES, EngineConfig, FinishEvent, Sequence, ServingEngine, TokenEvent
from workers.faults import FaultState
from workers.kvstore import CheckpointStore
from workers.openai_schema import parse
from workers.protocol import NodeStatus
from workers.runtime import Identity, NodeRuntime
from workers.telemetry import EmulatedTelemetry, emulated_gpus

DEPLOYMENT = catalog.Deployment.of("Qwen3-32B", "H100-SXM", 1)


def test_both_engines_are_serving_engines_with_the_members_of_what_they_offer():
    emulated = Engine(DEPLOYMENT)
    adapter = AdapterEngine("http://127.0.0.1:9", DEPLOYMENT, "adapter")
    for engine in (emulated, adapter):
        assert isinstance(engine, ServingEngine)
        assert engine.capabilities <= set(CAPABILITIES)
        for name in engine.capabilities:
            missing = [m for m in CAPABILITIES[name].members if not hasattr(engine, m)]
            assert not missing, f"{type(engine).__name__} offers {name} without {missing}"
    assert emulated.capabilities == set(CAPABILITIES)
    assert adapter.capabilities == {"resume"}  # by re-prefill: a stock engine's API offers none of the others
    assert emulated.describe() == {"kind": "emulated"} and adapter.describe() == {
        "kind": "vllm",
        "engine": "vLLM",
        "url": "http://127.0.0.1:9",
        "model": "Qwen/Qwen3-32B",
    }
    assert isinstance(emulated.status(), NodeStatus) and isinstance(adapter.status(), NodeStatus)
    assert not isinstance(object(), ServingEngine)


async def test_the_emulated_engine_takes_a_validated_request():
    engine = Engine(DEPLOYMENT, EngineConfig(time_scale=0.01))
    engine.start()
    try:
        req = parse(
            {"model": "Qwen3-32B", "prompt": "through the interface", "max_tokens": 12, "temperature": 0}, "completion"
        )
        seq = await engine.submit_request(req)
        assert isinstance(seq, Sequence) and seq.request_id == req.request_id
        ids = []
        while not isinstance(event := await seq.events.get(), FinishEvent):
            ids.append(event.token_id)
        assert ids == reference("Qwen3-32B", req.prompt_ids, 12) and event.reason in ("stop", "length")
    finally:
        await engine.stop()


class ScriptedEngine:
    """The least an engine can be: it answers every request with the same words, and offers no capability."""

    capabilities = frozenset()

    def __init__(self, words: list[str]):
        self.words = words
        self.deployment = DEPLOYMENT
        self.model = DEPLOYMENT.model
        self.model_state = "serving"
        self.counters = {"requests": 0}
        self.busy_s = 0.0
        self.used_blocks = 0
        self.by_id: dict[str, Sequence] = {}
        self.subscribers: set[asyncio.Queue] = set()

    def describe(self) -> dict:
        return {"kind": "scripted"}

    async def before_joining(self, wait_s: float) -> None:
        pass

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def begin_load(self, cold: bool = True) -> None:
        pass

    async def submit_request(self, req) -> Sequence:
        seq = Sequence(req.request_id, req.prompt_ids, req.params, arrival=time.monotonic())
        seq.first_token_at = time.monotonic()
        for i, word in enumerate(self.words):
            seq.events.put_nowait(TokenEvent(i, tokens.encode(word)[0], word, None, (), time.time()))
        seq.finished = "stop"
        seq.events.put_nowait(FinishEvent("stop", len(req.prompt_ids), len(self.words), time.time()))
        self.counters["requests"] += 1
        self.publish("finished")
        return seq

    def abort(self, request_id: str) -> None:
        pass

    def status(self) -> NodeStatus:
        return NodeStatus(at=time.time(), step_ms=None, steps=None, source="scripted")

    def subscribe(self) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self.subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        self.subscribers.discard(queue)

    def publish(self, reason: str) -> None:
        for queue in self.subscribers:
            queue.put_nowait({**self.status().to_json(), "reason": reason})


async def test_the_one_agent_serves_any_serving_engine():
    """A third kind of engine needs no app of its own: the agent calls nothing beyond the interface."""
    engine = ScriptedEngine([" one", " two", " three"])
    assert isinstance(engine, ServingEngine)
    faults = FaultState(enabled=False, tp=1)
    identity = Identity("scripted-1", "rack-a", "host", "s" * 32, emulated_gpus("scripted-1", DEPLOYMENT.gpu, 1))
    runtime = NodeRuntime(
        identity,
        engine,
        CheckpointStore(0),
        CheckpointStreamer("scripted-1", DEPLOYMENT.model, {}),
        faults,
        telemetry=None,
        agent_token="token",
    )
    runtime.telemetry = EmulatedTelemetry(identity.gpus, DEPLOYMENT, runtime.load_for_telemetry, faults)
    async with TestClient(TestServer(build_app(runtime))) as client:
        body = {"model": "Qwen3-32B", "prompt": "count", "max_tokens": 5}
        response = await client.post("/v1/completions", json=body)
        answer = await response.json()
        assert (
            response.status == 200
            and answer["choices"][0]["text"] == " one two three"
            and answer["usage"]["completion_tokens"] == 3
        )
        chat = {"model": "Qwen3-32B", "messages": [{"role": "user", "content": "count"}], "stream": True}
        response = await client.post("/v1/chat/completions", json=chat)
        chunks = [json.loads(line[6:]) for line in (await response.text()).splitlines() if line.startswith("data: {")]
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == " one two three"

        status = await (await client.get("/agent/status")).json()
        assert (
            status["engine"] == {"kind": "scripted"}
            and status["load"]["source"] == "scripted"
            and status["load"]["step_ms"] is None
        )
        assert status["counters"] == {"requests": 2, "steps": None}
        capabilities = await (await client.get("/agent/capabilities")).json()
        assert capabilities["offers"] == ["openai", "events", "telemetry"] and set(capabilities["cannot"]) == set(
            CAPABILITIES
        )
        response = await client.post("/agent/reload", headers={"Authorization": "Bearer token"})
        assert response.status == 501 and "`reload`" in (await response.json())["error"]["message"]
        # What the engine declares decides, not what kind it is: no tokenizer to serve, no model to switch.
        assert (await client.post("/tokenize", json={"prompt": "count"})).status in (404, 405)
        response = await client.post(
            "/agent/model", json={"model": "Qwen3-8B"}, headers={"Authorization": "Bearer token"}
        )
        assert (
            response.status == 501
            and "start the engine on the other model" in (await response.json())["error"]["message"]
        )
        metrics = await (await client.get("/metrics")).text()
        assert (
            'lifeline_model_ready{model_name="Qwen3-32B",node="scripted-1"} 1.0' in metrics
            and "lifeline_step_seconds" not in metrics
        )
        assert (await client.get("/health")).status == 200
