"""Front a real engine (vLLM, SGLang, anything with the OpenAI API and vLLM-style metrics).

`python -m workers.node --engine-url http://127.0.0.1:8000 --model Qwen3-32B --gpu H100-SXM --tp 2`

`AdapterEngine` is a workers.engine_api.ServingEngine: the node agent serves
it through the same HTTP face as the emulated engine. Each request goes to the
engine's OpenAI API as a stream, and comes back as the token and finish events
the emulated engine produces. The load status comes from the engine's
Prometheus metrics, polled every quarter second and after each request starts
and ends. What a stock engine cannot do through its API (stream KV pages to a
holder, resume from them, hand a request over, verify a draft model's tokens,
change its batch limit, reset its GPUs, inject faults) is not among its
capabilities: the agent answers 501 for it and lists it at
`/agent/capabilities`, rather than pretend.
"""

import asyncio
import json
import logging
import re
import time
from typing import cast

import aiohttp

from workers.catalog import Deployment
from workers.engine import EngineError, FinishEvent, Sequence, TokenEvent
from workers.openai_schema import ApiError, CompletionRequest
from workers.protocol import NodeStatus

log = logging.getLogger(__name__)

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(?P<value>[-+0-9.eEInfa]+)")
_UNREACHABLE = (aiohttp.ClientError, TimeoutError, OSError)


def parse_vllm_metrics(text: str) -> dict:
    """The load figures in a vLLM-style exposition, summed over label sets."""
    wanted = {
        "vllm:num_requests_running": "running",
        "vllm:num_requests_waiting": "waiting",
        "vllm:kv_cache_usage_perc": "kv_usage",
        "vllm:gpu_cache_usage_perc": "kv_usage",  # vLLM before 0.10
        "vllm:generation_tokens_total": "generation_tokens",
        "vllm:prompt_tokens_total": "prompt_tokens",
    }
    figures: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match["name"] in wanted:
            key = wanted[match["name"]]
            figures[key] = figures.get(key, 0.0) + float(match["value"])
    return figures


class AdapterEngine:
    """A real engine behind the node agent: requests go to its OpenAI API, load comes from its metrics."""

    # A stock engine's API offers none of the capabilities beyond serving (see the module docstring).
    capabilities: frozenset[str] = frozenset()

    def __init__(self, engine_url: str, deployment: Deployment, name: str, poll_s: float = 0.25):
        self.engine_url = engine_url.rstrip("/")
        self.deployment = deployment
        self.model = deployment.model
        self.name = name
        self.poll_s = poll_s
        self.model_state = "loading_full"  # until the engine answers /health
        self.figures: dict[str, float] = {}
        self.status_seq = 0
        self.busy_s = 0.0
        self.used_blocks = 0
        self.counters: dict[str, float] = {"requests_proxied": 0, "engine_errors": 0, "poll_failures": 0}
        self.last_poll_at: float | None = None
        self.by_id: dict[str, Sequence] = {}  # requests this node has passed on and not seen end
        self._relays: dict[str, tuple[asyncio.Task, aiohttp.ClientResponse]] = {}  # each one's task and stream
        self._subscribers: set[asyncio.Queue] = set()
        self._poke = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.session: aiohttp.ClientSession | None = None

    def describe(self) -> dict:
        return {"kind": "adapter", "url": self.engine_url}

    # --- lifecycle -------------------------------------------------------------
    def start(self) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=5, sock_read=600))
        self._task = asyncio.get_running_loop().create_task(self._poll_loop(self.session), name="engine-metrics")

    async def stop(self) -> None:
        tasks = [task for task, _ in self._relays.values()]
        for request_id in list(self.by_id):
            self.abort(request_id)
        if self._task is not None:
            tasks.append(self._task)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    def begin_load(self, cold: bool = True) -> None:
        pass  # the engine loads its own model; /health tells when it is ready

    # --- requests ----------------------------------------------------------------
    async def submit_request(self, req: CompletionRequest) -> Sequence:
        """Send the request to the engine as a stream; its chunks become this sequence's events."""
        if req.request_id in self.by_id:
            raise EngineError(f"request id {req.request_id!r} is already running on this node")
        body = {key: value for key, value in req.body.items() if key != "lifeline"}
        # A stream always, whatever the client asked: the agent writes the answer, whole or
        # streamed, from the events. The usage chunk has the engine's own token counts, and
        # vLLM's return_token_ids extension puts the token ids in each chunk. The client's
        # logprobs parameters go as they came, so the engine reports them when asked.
        body.update(stream=True, stream_options={"include_usage": True}, return_token_ids=True)
        path = "/v1/completions" if req.kind == "completion" else "/v1/chat/completions"
        self.counters["requests_proxied"] += 1
        assert self.session is not None, "start() opens the session before the agent sends any request"
        try:
            upstream = await self.session.post(
                self.engine_url + path, json=body, headers={"X-Request-Id": req.request_id}
            )
        except _UNREACHABLE as exc:
            self.counters["engine_errors"] += 1
            raise EngineError(
                f"The engine at {self.engine_url} did not answer: {exc.__class__.__name__}.", status=502
            ) from None
        if upstream.status != 200:
            async with upstream:
                raise await self._refusal(upstream)
        seq = Sequence(req.request_id, list(req.prompt_ids), req.params, arrival=time.monotonic())
        self.by_id[req.request_id] = seq
        relay = asyncio.get_running_loop().create_task(self._relay(seq, req, upstream), name=f"relay-{req.request_id}")
        self._relays[req.request_id] = (relay, upstream)
        self.poke()
        return seq

    async def _refusal(self, upstream: aiohttp.ClientResponse) -> ApiError:
        """The engine's refusal, relayed in OpenAI's shape with its own status, message and field."""
        text = await upstream.text()
        try:
            error = json.loads(text)
            error = error.get(
                "error", error
            )  # OpenAI's {"error": {...}}, or vLLM's older flat {"object": "error", ...}
            kind = str(error.get("type") or "engine_error")
            return ApiError(
                upstream.status, str(error["message"]), param=error.get("param"), kind=kind, code=error.get("code")
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            message = f"The engine at {self.engine_url} answered {upstream.status}: {text[:200]}"
            return ApiError(upstream.status, message, kind="engine_error")

    async def _relay(self, seq: Sequence, req: CompletionRequest, upstream: aiohttp.ClientResponse) -> None:
        """Turn the engine's server-sent events into the sequence's token events and its finish."""
        reason: str | None = None
        detail: dict | None = None
        usage: dict = {}
        try:
            async with upstream:
                async for line in upstream.content:
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    chunk = json.loads(data)
                    if not isinstance(chunk, dict):
                        raise ValueError(f"a chunk is {type(chunk).__name__}, not an object")
                    if "error" in chunk or chunk.get("object") == "error":
                        error = chunk.get("error", chunk)
                        message = error.get("message", "no message")
                        reason, detail = "error", {"reason": f"the engine at {self.engine_url} failed: {message}"}
                        break
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or ():
                        self._tokens(seq, req.kind, choice)
                        reason = choice.get("finish_reason") or reason
        except _UNREACHABLE as exc:
            reason, detail = (
                "error",
                {"reason": f"the engine at {self.engine_url} broke off the stream: {exc.__class__.__name__}"},
            )
        except (ValueError, KeyError, TypeError) as exc:
            reason, detail = (
                "error",
                {"reason": f"the engine at {self.engine_url} sent a chunk this node cannot read: {exc!r}"},
            )
        if reason is None:
            reason, detail = "error", {"reason": f"the engine at {self.engine_url} ended the stream without a finish"}
        self._finish(seq, reason, detail, usage)

    def _tokens(self, seq: Sequence, kind: str, choice: dict) -> None:
        """The token events of one chunk's choice: one per token id, else one per chunk that has text."""
        text = (choice.get("text") if kind == "completion" else (choice.get("delta") or {}).get("content")) or ""
        ids = choice.get("token_ids") or []
        logprobs = _logprobs(choice.get("logprobs"), kind)
        # Without token ids or logprobs a chunk's tokens cannot be counted: it counts as one.
        # A chunk with nothing in it (a chat stream's first, with only the role) is no token.
        count = max(len(ids), len(logprobs), 1 if text else 0)
        now = time.time()
        # Sequence.generated is typed for the emulated engine's ids; here an id may be unknown (None).
        generated = cast("list[int | None]", seq.generated)
        for i in range(count):
            # An engine without return_token_ids does not say the id: it stays unknown (None),
            # and a client asking for token ids gets none for it.
            token_id = ids[i] if i < len(ids) else None
            token, logprob, top = logprobs[i] if i < len(logprobs) else (None, None, ())
            piece = text if i == 0 else ""  # a chunk's text is not split between its tokens: the first carries it
            if seq.first_token_at is None:
                seq.first_token_at = time.monotonic()
            generated.append(token_id)
            seq.text += piece
            seq.events.put_nowait(TokenEvent(len(generated) - 1, token_id, piece, logprob, top, now, token))

    def abort(self, request_id: str) -> None:
        seq = self.by_id.get(request_id)
        if seq is None:
            return
        relay = self._relays.pop(request_id, None)
        if relay is not None:
            relay[1].close()  # the engine sees its client gone and aborts the request; the relay then ends
        self._finish(seq, "abort")

    def _finish(self, seq: Sequence, reason: str, detail: dict | None = None, usage: dict | None = None) -> None:
        if seq.finished is not None:
            return
        seq.finished = reason
        self.by_id.pop(seq.request_id, None)
        self._relays.pop(seq.request_id, None)
        if reason == "error":
            self.counters["engine_errors"] += 1
            log.warning("%s: request %s failed: %s", self.name, seq.request_id, (detail or {}).get("reason"))
        # The engine's own counts where it gives them; else the prompt as this node tokenized it
        # (a different tokenizer: an estimate) and the tokens relayed.
        usage = usage or {}
        seq.events.put_nowait(
            FinishEvent(
                reason,
                int(usage.get("prompt_tokens", len(seq.prompt_ids))),
                int(usage.get("completion_tokens", len(seq.generated))),
                time.time(),
                detail,
            )
        )
        self.poke()

    # --- load, from the engine's metrics -----------------------------------------------
    async def _poll_loop(self, session: aiohttp.ClientSession) -> None:
        while True:
            await self._poll(session)
            try:
                await asyncio.wait_for(self._poke.wait(), timeout=self.poll_s)
            except TimeoutError:
                pass
            self._poke.clear()

    async def _poll(self, session: aiohttp.ClientSession) -> None:
        try:
            async with session.get(self.engine_url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as health:
                state = "serving" if health.status == 200 else "loading_full"
            async with session.get(self.engine_url + "/metrics", timeout=aiohttp.ClientTimeout(total=2)) as response:
                figures = parse_vllm_metrics(await response.text())
        except _UNREACHABLE as exc:
            self.counters["poll_failures"] += 1
            if self.model_state == "serving":
                log.warning("engine at %s stopped answering: %s", self.engine_url, exc)
            state, figures = "loading_full", {}
        changed = (
            state != self.model_state
            or figures.get("running") != self.figures.get("running")
            or figures.get("waiting") != self.figures.get("waiting")
        )
        now = time.monotonic()
        if self.last_poll_at is not None and figures.get("running"):
            self.busy_s += now - self.last_poll_at
        self.last_poll_at = now
        self.model_state, self.figures = state, figures
        self.used_blocks = int(figures.get("kv_usage", 0.0) * self.deployment.kv_blocks)
        if changed:
            self.publish("engine_metrics")

    def poke(self) -> None:
        """Read the engine's metrics now: a request started or ended."""
        self._poke.set()

    def status(self) -> NodeStatus:
        f = self.figures
        # What a stock engine does not export is None (n/a), never zero.
        return NodeStatus(
            seq=self.status_seq,
            at=time.time(),
            model_state=self.model_state,
            load_progress=1.0 if self.model_state == "serving" else None,
            waiting=int(f["waiting"]) if "waiting" in f else None,
            running=int(f["running"]) if "running" in f else None,
            uncomputed_prefill_tokens=None,
            decode_batch=None,
            decode_context_tokens=None,
            kv_blocks_used=self.used_blocks if "kv_usage" in f else None,
            kv_blocks_total=self.deployment.kv_blocks,
            checkpoint_bytes_held=None,
            checkpoint_budget_bytes=None,
            checkpoint_requests=None,
            step_ms=None,
            steps=None,
            time_scale=None,
            decode_step_ms=None,
            decode_step_batch=None,
            decode_step_context_tokens=None,
            batch_limit=None,
            batch_factor=None,
            assist=None,
            in_flight=len(self.by_id),
            source="engine_metrics",
        )

    def subscribe(self) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue(maxsize=256)
        self._subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        self._subscribers.discard(queue)

    def publish(self, reason: str) -> None:
        self.status_seq += 1
        status = {**self.status().to_json(), "reason": reason}
        for queue in list(self._subscribers):
            if queue.full():
                queue.get_nowait()
            queue.put_nowait(status)


def _logprobs(logprobs: dict | None, kind: str) -> list[tuple[str, float | None, tuple[tuple[str, float], ...]]]:
    """(token, logprob, top candidates) per token of a chunk, as the engine spells its tokens."""
    if not logprobs:
        return []
    if kind == "completion":
        spelled, chosen, tops = (
            logprobs.get("tokens") or [],
            logprobs.get("token_logprobs") or [],
            logprobs.get("top_logprobs") or [],
        )
        return [
            (spelled[i], chosen[i], tuple((tops[i] or {}).items()) if i < len(tops) else ())
            for i in range(min(len(spelled), len(chosen)))
        ]
    return [
        (item["token"], item.get("logprob"), tuple((c["token"], c["logprob"]) for c in item.get("top_logprobs") or ()))
        for item in logprobs.get("content") or ()
    ]
