"""Front a real engine: vLLM, SGLang or llama.cpp's server, through its own API.

`python -m workers.node --engine-url http://127.0.0.1:8000 --engine-kind vllm --model Qwen3-32B --gpu H100-SXM --tp 2`

`AdapterEngine` is a workers.engine_api.ServingEngine: the node agent serves it
through the same HTTP face as the emulated engine, so the gateway routes,
watches, canaries and resumes a real engine's node like any other. What
differs between engines is one `Dialect` each, saying how that engine's API
gives what Lifeline needs:

- Token ids. Every request goes to the engine as token ids: the prompt
  rendered and tokenized by the engine itself (its chat template, its
  tokenizer), then generated with the engine's token ids and log
  probabilities in each chunk. So the gateway knows exactly which tokens the
  client has, and a canary compares real tokens and log probabilities.
- Resume by re-prefill (document 003). A request another node was serving
  arrives with the ids the client already has; the engine gets the prompt's
  ids followed by those, with the remaining max_tokens. At temperature 0 the
  continuation is the text an undisturbed run gives. The KV of a stock
  engine cannot be streamed or restored, so the "checkpoint" capability is
  not offered and the gateway places no holders on such a node.
- Load (document 002). The engine's own Prometheus series (its running and
  waiting requests, its KV usage) are polled every quarter second and after
  each arrival and finish; what an engine does not export is taken from the
  adapter's account of the requests it forwarded: the prompt tokens not yet
  prefilled (no first token yet), the decode batch and the context it
  attends, and the step time measured between tokens. Each arrival and
  finish is published as an event, as the emulated engine does, so the
  gateway's dispatch ledger settles.

What a stock engine cannot do through its API (stream KV pages to a holder,
hand a request over at a token boundary, verify a draft model's tokens,
change its batch limit, inject faults) is not among its capabilities: the
agent answers 501 for it and lists it at `/agent/capabilities`, rather than
pretend. Reloading the model and resetting the GPUs are offered only where
the node owns the engine's process (`--engine-command`,
workers.engine_process): reload is the engine's graceful shutdown and a fresh
start, reset the same with the GPU reset between the two where the host
allows it.

Before the node registers, `probe` checks that the engine answers the way its
dialect expects: the model it serves, the metric series, token ids in its
stream. A node whose engine does not is refused with what is missing and what
to set, never half-used.
"""

import asyncio
import codecs
import json
import logging
import math
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import ClassVar, cast

import aiohttp

from workers.catalog import BLOCK_TOKENS, Deployment
from workers.engine_api import EngineError, FinishEvent, ResumeInfo, Sequence, TokenEvent
from workers.engine_process import EngineProcess
from workers.openai_schema import ApiError, CompletionRequest, parse
from workers.protocol import NodeStatus
from workers.status_feed import StatusFeed

log = logging.getLogger(__name__)

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(?P<value>[-+0-9.eEInfa]+)")
_UNREACHABLE = (aiohttp.ClientError, TimeoutError, OSError)
PROBE_AGAIN_S = 2.0  # a restarted engine that answers /health but fails the probe is probed again after this
GIVE_UP_AFTER_EXITS = 3  # an engine this node starts that exits this often without answering is given up on
STEP_EWMA = 0.2  # weight of the newest inter-token gap in the measured step time


class EngineMismatch(Exception):
    """The engine does not answer the way its adapter needs; the message says what is missing and what to set."""


# --- one token, as any engine says it -------------------------------------------------------------
@dataclass
class Piece:
    token_id: int | None
    text: str
    logprob: float | None = None
    token: str | None = None  # as the engine spells it in its logprobs
    top: tuple[tuple[int | str, float], ...] = ()


@dataclass
class Chunk:
    """What one streamed message of the engine says: new tokens, and perhaps the end."""

    pieces: list[Piece] = field(default_factory=list)
    finish: str | None = None  # OpenAI's finish_reason: "stop", "length", ...
    usage: dict | None = None  # the engine's own token counts, when it gives them
    error: str | None = None


def parse_metrics(text: str, series: dict[str, str]) -> dict[str, float]:
    """The figures named in `series` (exposition name -> figure), summed over label sets."""
    figures: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match["name"] in series:
            key = series[match["name"]]
            figures[key] = figures.get(key, 0.0) + float(match["value"])
    return figures


class Dialect:
    """How one engine's API gives what Lifeline needs. Subclasses say it for vLLM, SGLang and llama.cpp."""

    kind: ClassVar[str]
    title: ClassVar[str]
    series: ClassVar[dict[str, str]]  # Prometheus name -> figure
    required: ClassVar[dict[str, str]]  # figure -> what to do when the engine does not export it

    def figures(self, text: str) -> dict[str, float]:
        return parse_metrics(text, self.series)

    async def served_models(self, session: aiohttp.ClientSession, url: str) -> list[str]:
        async with session.get(url + "/v1/models", timeout=aiohttp.ClientTimeout(total=5)) as response:
            if response.status != 200:  # loading still (503), or no such route: no listing to read
                raise ValueError(f"HTTP {response.status}")
            data = await response.json(content_type=None)
        if not isinstance(data, dict):
            raise ValueError(f"not a model list: {str(data)[:80]!r}")
        return [str(m.get("id")) for m in data.get("data") or () if isinstance(m, dict)]

    async def prompt_ids(
        self, session: aiohttp.ClientSession, url: str, model: str, req: CompletionRequest
    ) -> list[int]:
        """The request's prompt as the engine's own tokens (its chat template applied for a chat).

        vLLM's /tokenize, which SGLang serves too: a prompt, or chat messages with the generation prompt added.
        """
        given = _given_prompt_ids(req) if req.kind == "completion" else None
        if given is not None:
            return given
        if req.kind == "chat":
            body = {"model": model, "messages": req.body["messages"], "add_generation_prompt": True}
        else:
            body = {"model": model, "prompt": _prompt_text(req), "add_special_tokens": True}
        what = f"{self.title}'s /tokenize"
        async with _post_json(session, url + "/tokenize", body) as response:
            return _ids((await _answer(response, what)).get("tokens"), what)

    def generation(self, model: str, ids: list[int], req: CompletionRequest, done: int) -> tuple[str, dict]:
        """The path and body that generate from `ids`, `done` output tokens already sent."""
        raise NotImplementedError

    def read(self, data: dict, state: dict) -> Chunk:
        """One streamed message of the engine; `state` is the request's own, kept between its messages."""
        raise NotImplementedError


def _post_json(session: aiohttp.ClientSession, url: str, body: dict):
    return session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=30))


async def _answer(response: aiohttp.ClientResponse, what: str) -> dict:
    if response.status != 200:
        raise EngineError(f"{what} answered {response.status}: {(await response.text())[:200]}", status=502)
    data = await response.json(content_type=None)
    if not isinstance(data, dict):
        raise EngineError(f"{what} answered {type(data).__name__}, not an object", status=502)
    return data


def _ids(value, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) for t in value):
        raise EngineError(f"{what} gave no token ids", status=502)
    return value


def _remaining(req: CompletionRequest, done: int) -> tuple[int, int]:
    """max_tokens and min_tokens left once `done` output tokens are sent."""
    return req.params.max_tokens - done, max(req.params.min_tokens - done, 0)


def _given_prompt_ids(req: CompletionRequest) -> list[int] | None:
    """A completion whose prompt the client gave as token ids: the engine's ids already."""
    prompt = req.body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    return None


def _prompt_text(req: CompletionRequest) -> str:
    prompt = req.body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else "<|endoftext|>"  # OpenAI's default: a new document


class Vllm(Dialect):
    """vLLM's OpenAI server: /tokenize (with the chat template), /v1/completions with `return_token_ids`."""

    kind = "vllm"
    title = "vLLM"
    series = {
        "vllm:num_requests_running": "running",
        "vllm:num_requests_waiting": "waiting",
        "vllm:kv_cache_usage_perc": "kv_usage",
        "vllm:gpu_cache_usage_perc": "kv_usage",  # vLLM before 0.10
        "vllm:generation_tokens_total": "generation_tokens",
        "vllm:prompt_tokens_total": "prompt_tokens",
        "vllm:num_preemptions_total": "preemptions",
    }
    required = {
        "running": "vLLM exports vllm:num_requests_running at /metrics unless --disable-log-stats is set: remove it",
        "waiting": "vLLM exports vllm:num_requests_waiting at /metrics unless --disable-log-stats is set: remove it",
    }

    def generation(self, model, ids, req, done):
        p = req.params
        max_tokens, min_tokens = _remaining(req, done)
        body: dict = {
            "model": model,
            "prompt": ids,
            "max_tokens": max_tokens,
            "min_tokens": min_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": p.top_k,
            "min_p": p.min_p,
            "seed": p.seed,
            "ignore_eos": p.ignore_eos,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,  # vLLM >= 0.10.2: each chunk carries its tokens' ids
        }
        if p.stop:
            body["stop"] = list(p.stop)
        if p.logprobs is not None:
            body["logprobs"] = max(p.logprobs, 1)
        return "/v1/completions", body

    def read(self, data, state):
        if "error" in data or data.get("object") == "error":
            error = data.get("error", data)
            return Chunk(error=str(error.get("message", "no message")) if isinstance(error, dict) else str(error))
        chunk = Chunk(usage=data.get("usage") or None)
        for choice in data.get("choices") or ():
            ids = choice.get("token_ids") or []
            logprobs = choice.get("logprobs") or {}
            spelled, chosen = logprobs.get("tokens") or [], logprobs.get("token_logprobs") or []
            tops = logprobs.get("top_logprobs") or []
            text = choice.get("text") or ""
            count = max(len(ids), len(chosen), 1 if text else 0)
            for i in range(count):
                chunk.pieces.append(
                    Piece(
                        ids[i] if i < len(ids) else None,
                        text if i == 0 else "",  # not split between its tokens: the first has it, all go out as one
                        chosen[i] if i < len(chosen) else None,
                        spelled[i] if i < len(spelled) else None,
                        tuple((tops[i] or {}).items()) if i < len(tops) else (),
                    )
                )
            chunk.finish = choice.get("finish_reason") or chunk.finish
        return chunk


class Sglang(Dialect):
    """SGLang's server: /tokenize, then its native /generate with `input_ids` and token logprobs."""

    kind = "sglang"
    title = "SGLang"
    series = {
        "sglang:num_running_reqs": "running",
        "sglang:num_queue_reqs": "waiting",
        "sglang:token_usage": "kv_usage",
        "sglang:generation_tokens_total": "generation_tokens",
        "sglang:prompt_tokens_total": "prompt_tokens",
    }
    required = {
        "running": "start SGLang with --enable-metrics so that /metrics exports sglang:num_running_reqs",
        "waiting": "start SGLang with --enable-metrics so that /metrics exports sglang:num_queue_reqs",
    }

    def generation(self, model, ids, req, done):
        p = req.params
        max_tokens, min_tokens = _remaining(req, done)
        sampling = {
            "max_new_tokens": max_tokens,
            "min_new_tokens": min_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": p.top_k,
            "min_p": p.min_p,
            "ignore_eos": p.ignore_eos,
            "sampling_seed": p.seed,
        }
        if p.stop:
            sampling["stop"] = list(p.stop)
        body = {
            "input_ids": ids,
            "sampling_params": sampling,
            "stream": True,
            # The token ids come with their logprobs: (logprob, id, text) per output token.
            "return_logprob": True,
            "logprob_start_len": -1,
            "top_logprobs_num": p.logprobs or 0,
            "return_text_in_logprobs": True,
        }
        return "/generate", body

    def read(self, data, state):
        if "error" in data:
            error = data["error"]
            return Chunk(error=str(error.get("message")) if isinstance(error, dict) else str(error))
        meta = data.get("meta_info") or {}
        # SGLang streams the output so far: the tokens beyond those already read are new.
        entries = meta.get("output_token_logprobs") or []
        tops = meta.get("output_top_logprobs") or []
        count, text_before = state.get("seen", (0, ""))
        text = data.get("text") or ""
        new_text = text[len(text_before) :] if text.startswith(text_before) else text
        chunk = Chunk()
        for i, entry in enumerate(entries[count:], start=count):
            logprob, token_id, spelled = (list(entry) + [None, None, None])[:3]
            top = tuple((t[2] if t[2] is not None else t[1], t[0]) for t in (tops[i] or ())) if i < len(tops) else ()
            chunk.pieces.append(Piece(token_id, new_text if i == count else "", logprob, spelled, top))
        state["seen"] = (max(count, len(entries)), text)
        finish = meta.get("finish_reason")
        if isinstance(finish, dict):
            chunk.finish = {"length": "length"}.get(str(finish.get("type")), "stop")
            chunk.usage = {
                "prompt_tokens": meta.get("prompt_tokens"),
                "completion_tokens": meta.get("completion_tokens"),
            }
        return chunk


class LlamaCpp(Dialect):
    """llama.cpp's llama-server: /apply-template and /tokenize, then /completion with `return_tokens`."""

    kind = "llamacpp"
    title = "llama.cpp"
    series = {
        "llamacpp:requests_processing": "running",
        "llamacpp:requests_deferred": "waiting",
        "llamacpp:prompt_tokens_total": "prompt_tokens",
        "llamacpp:tokens_predicted_total": "generation_tokens",
    }
    required = {
        "running": "start llama-server with --metrics so that /metrics exports llamacpp:requests_processing",
    }
    STOPS = {"eos": "stop", "word": "stop", "limit": "length"}

    async def prompt_ids(self, session, url, model, req):
        given = _given_prompt_ids(req) if req.kind == "completion" else None
        if given is not None:
            return given
        if req.kind == "chat":
            body = {"messages": req.body["messages"]}
            async with _post_json(session, url + "/apply-template", body) as response:
                prompt = (await _answer(response, "llama-server's /apply-template")).get("prompt")
            if not isinstance(prompt, str):
                raise EngineError("llama-server's /apply-template gave no prompt", status=502)
        else:
            prompt = _prompt_text(req)
        # As llama-server tokenizes a prompt it is sent as text: special tokens added and parsed.
        body = {"content": prompt, "add_special": True, "parse_special": True}
        async with _post_json(session, url + "/tokenize", body) as response:
            return _ids((await _answer(response, "llama-server's /tokenize")).get("tokens"), "llama-server's /tokenize")

    def generation(self, model, ids, req, done):
        p = req.params
        max_tokens, _ = _remaining(req, done)
        body = {
            "prompt": ids,
            "n_predict": max_tokens,
            "temperature": p.temperature,
            # OpenAI's sampling, not llama.cpp's defaults (top_k 40, top_p 0.95, min_p 0.05).
            "top_k": max(p.top_k, 0),
            "top_p": p.top_p,
            "min_p": p.min_p,
            "seed": p.seed,
            "ignore_eos": p.ignore_eos,
            # At least one: each token's own bytes come with its probabilities, and the text is built from
            # those. The stream's `content` may hold text back (a possible stop word) past the token it belongs
            # to, and text held back when a node dies would be lost to the client.
            "n_probs": max(p.logprobs or 0, 1),
            "stream": True,
            "return_tokens": True,  # prompt caching as the server was started (--no-cache-prompt turns it off)
        }
        if p.stop:
            body["stop"] = list(p.stop)
        return "/completion", body

    def read(self, data, state):
        if "error" in data:
            error = data["error"]
            return Chunk(error=str(error.get("message")) if isinstance(error, dict) else str(error))
        ids = data.get("tokens") or []
        probs = data.get("completion_probabilities") or []
        wanted = state.get("logprobs")  # the client's: None for no logprobs, else how many top candidates
        decoder = state.setdefault("utf8", codecs.getincrementaldecoder("utf-8")(errors="replace"))
        chunk = Chunk()
        for i in range(max(len(ids), len(probs))):
            prob = probs[i] if i < len(probs) else {}
            token_id = ids[i] if i < len(ids) else prob.get("id")
            if "bytes" in prob:
                text = decoder.decode(bytes(prob["bytes"]))
            else:  # no probabilities: the stream's own text, the first token carrying it
                text = (data.get("content") or "") if i == 0 else ""
            if wanted is None:
                chunk.pieces.append(Piece(token_id, text))
                continue
            top = tuple((t.get("token"), t.get("logprob")) for t in prob.get("top_logprobs") or ())[:wanted]
            chunk.pieces.append(Piece(token_id, text, prob.get("logprob"), prob.get("token"), top))
        if data.get("stop"):
            chunk.finish = self.STOPS.get(str(data.get("stop_type")), "stop")
            chunk.usage = {
                "prompt_tokens": data.get("tokens_evaluated"),
                "completion_tokens": data.get("tokens_predicted"),
            }
        return chunk


DIALECTS: dict[str, type[Dialect]] = {d.kind: d for d in (Vllm, Sglang, LlamaCpp)}


def detect(metrics_text: str) -> str | None:
    """Which engine exported this /metrics page, by its series' prefix."""
    for kind, prefix in (("vllm", "vllm:"), ("sglang", "sglang:"), ("llamacpp", "llamacpp:")):
        if re.search(rf"^{re.escape(prefix)}", metrics_text, re.MULTILINE):
            return kind
    return None


# --- the adapter's account of what it forwarded --------------------------------------------------
@dataclass
class Forwarded:
    seq: Sequence
    prompt_tokens: int  # the engine's own count
    first_token_at: float | None = None
    last_token_at: float | None = None


class AdapterEngine:
    """A real engine behind the node agent: requests go to it as token ids, load comes from its metrics."""

    def __init__(
        self,
        engine_url: str,
        deployment: Deployment,
        name: str,
        kind: str = "vllm",
        engine_model: str | None = None,
        poll_s: float = 0.25,
        process: EngineProcess | None = None,
        ready_wait_s: float = 900.0,
    ):
        if kind not in DIALECTS and kind != "auto":
            raise ValueError(f"unknown engine kind {kind!r}: expected auto or one of {', '.join(DIALECTS)}")
        self.engine_url = engine_url.rstrip("/")
        self.deployment = deployment
        self.model = deployment.model
        self.name = name
        self.kind = kind  # "auto" until `identify` reads the engine's metrics
        self.dialect: Dialect = DIALECTS.get(kind, Vllm)()
        self.engine_model_given = engine_model is not None
        self.engine_model = engine_model or deployment.model.name  # the name the engine serves it under
        self.poll_s = poll_s
        self.model_state = "loading_full"  # until the engine answers /health and `probe` found it fit
        self.engine_ready = False  # the engine answers /health
        self.verified = False  # `probe` found nothing missing: until then the node takes no request
        self.figures: dict[str, float] = {}
        self.status_seq = 0
        self.busy_s = 0.0
        self.used_blocks = 0
        self.tokens_relayed = 0  # every token the engine gave: it progressed (the status's `steps`)
        self.step_s: float | None = None  # measured: the gap between one stream's tokens
        self.counters: dict[str, float] = {"requests_proxied": 0, "engine_errors": 0, "poll_failures": 0}
        self.last_poll_at: float | None = None
        self.forwarded: dict[str, Forwarded] = {}  # requests passed on and not seen end
        self._relays: dict[str, tuple[asyncio.Task, aiohttp.ClientResponse | None]] = {}
        self._feed = StatusFeed()  # the status events' subscribers
        self._poke = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.session: aiohttp.ClientSession | None = None
        self.process = process  # the engine's process, where this node owns it (--engine-command)
        self.ready_wait_s = ready_wait_s  # how long a restarted engine may take to answer /health
        self._restarting: asyncio.Task | None = None
        if process is not None:
            process.on_exit = self._on_engine_exit
            process.on_start = self._reverify

    @property
    def capabilities(self) -> frozenset[str]:
        """Resume by re-prefill only: a stock engine's KV can be neither streamed to a holder nor restored. Reload
        and GPU reset where this node owns the engine's process (the reset where the host allows it)."""
        offered = {"resume"}
        if self.process is not None:
            offered.add("reload")
            if self.process.can_reset:
                offered.add("reset")
        return frozenset(offered)

    def describe(self) -> dict:
        title = self.dialect.title if self.kind != "auto" else "not identified yet"
        described: dict[str, object] = {
            "kind": self.kind,
            "engine": title,
            "url": self.engine_url,
            "model": self.engine_model,
        }
        if self.process is not None:
            described["process"] = self.process.describe()
        return described

    # --- lifecycle -------------------------------------------------------------
    def start(self) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=5, sock_read=600))
        self._start_polling()

    def _start_polling(self) -> None:
        assert self.session is not None, "start() opens the session first"
        self._task = asyncio.get_running_loop().create_task(self._poll_loop(self.session), name="engine-metrics")

    async def start_process(self) -> None:
        """Start the engine this node owns (before waiting for it to answer)."""
        if self.process is not None:
            await self.process.start()

    async def before_joining(self, wait_s: float) -> None:
        """Before the node registers: the engine it owns started (--engine-command), then the real engine answering as
        this adapter needs, or EngineMismatch (EngineStartError) saying why, and the node stops rather than join."""
        await self.start_process()
        if not await self.wait_ready(wait_s):
            process = self.process
            if process is not None and process.exits_unanswered >= GIVE_UP_AFTER_EXITS:
                raise EngineMismatch(
                    f"the engine this node starts ({process.describe()['command']}) exited "
                    f"{process.exits_unanswered} times before it answered /health at {self.engine_url}"
                    + (
                        f": see its output in {process.log_path}"
                        if process.log_path
                        else ": give --engine-log to see why"
                    )
                )
            raise EngineMismatch(
                f"the engine at {self.engine_url} did not answer /health with 200 within {wait_s:.0f} s"
            )
        await self.identify()
        problems = await self.probe()
        if problems:
            raise EngineMismatch(
                f"refusing to register in front of the engine at {self.engine_url}:\n  - " + "\n  - ".join(problems)
            )
        log.info("%s: the engine at %s answers as %s needs", self.name, self.engine_url, self.dialect.title)

    async def stop(self) -> None:
        tasks = [task for task, _ in self._relays.values()]
        for request_id in list(self.forwarded):
            self.abort(request_id)
        if self._task is not None:
            tasks.append(self._task)
        if self._restarting is not None:
            tasks.append(self._restarting)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.process is not None:
            await self.process.stop()  # its graceful shutdown: no engine outlives its sidecar
        if self.session is not None:
            await self.session.close()

    # --- the engine's process, where this node owns it ------------------------------------------
    def reload(self, cold: bool = True) -> int:
        """The engine's graceful shutdown and a fresh start (a drain's remediation). Every request still in flight
        fails (the drain moved them first; the gateway resumes any left). Returns how many failed."""
        return self._restart("reload", reset=False)

    def reset_gpus(self) -> int:
        """The engine stopped, the GPUs reset, the engine started again. Returns how many requests failed."""
        return self._restart("GPU reset", reset=True)

    def _restart(self, why: str, reset: bool) -> int:
        assert self.process is not None, "offered only where the node owns the engine"
        failed = self._out_of_service(f"{why} of the engine on node {self.name}")
        if self._restarting is not None and not self._restarting.done():
            return failed  # one under way already: it ends in a fresh, verified engine
        self._restarting = asyncio.get_running_loop().create_task(self._restart_process(reset), name="engine-restart")
        self._restarting.add_done_callback(self._said_if_failed)
        return failed

    def _said_if_failed(self, task: asyncio.Task) -> None:
        """A restart that raised leaves the node out of service: said, not kept in a task nobody awaits."""
        if not task.cancelled() and task.exception() is not None:
            log.error("%s: the engine's restart failed", self.name, exc_info=task.exception())

    async def _restart_process(self, reset: bool) -> None:
        assert self.process is not None
        # No polls while the engine stops: llama-server's exit waits for every handler it has taken on, a /metrics
        # poll's until its client gives up (seconds, longer under load), and a GPU reset waits for that exit.
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        # A poll may have read the old engine's /health between the restart's request and the cancellation above:
        # its answer says nothing of the engine started next, which is to be waited for from here.
        self.engine_ready = self.verified = False
        try:
            await self.process.restart(reset=reset)
        finally:
            current = asyncio.current_task()
            if current is None or not current.cancelling():  # cancelled: the node is stopping, and polls no more
                self._start_polling()
        await self._reverify()

    def _out_of_service(self, reason: str) -> int:
        """Until the engine answers as before, the node serves nothing; what runs there fails, to be resumed."""
        self.verified = False
        self.engine_ready = False
        failed = 0
        for request_id, forwarded in list(self.forwarded.items()):
            relay = self._relays.pop(request_id, None)
            if relay is not None and relay[1] is not None:
                relay[1].close()
            self._finish(forwarded.seq, "error", {"reason": reason})
            failed += 1
        if self.model_state != "loading_full":
            self.model_state = "loading_full"
            self.publish("engine_restarting")
        return failed

    async def _on_engine_exit(self, code: int) -> None:
        self._out_of_service(f"the engine of node {self.name} exited ({code})")

    async def _reverify(self) -> None:
        """A restarted engine serves again once it answers /health and as its dialect needs (`probe`). An engine
        that has just begun to answer may still fail a probe (its model listing or metrics not up yet, a loaded
        host's timeout): it is probed again every PROBE_AGAIN_S until `ready_wait_s` has passed since the start."""
        deadline = time.monotonic() + self.ready_wait_s
        while True:
            if not await self.wait_ready(deadline - time.monotonic()):
                log.error("%s: the restarted engine did not answer /health within %.0f s", self.name, self.ready_wait_s)
                return
            problems = await self.probe()
            if not problems:
                log.info("%s: the restarted engine answers as %s needs; serving again", self.name, self.dialect.title)
                return
            if time.monotonic() + PROBE_AGAIN_S > deadline:
                log.error("%s: the restarted engine is refused: %s", self.name, "; ".join(problems))
                return
            log.warning(
                "%s: the restarted engine is not serving yet: %s; probing again in %g s",
                self.name,
                "; ".join(problems),
                PROBE_AGAIN_S,
            )
            await asyncio.sleep(PROBE_AGAIN_S)

    def begin_load(self, cold: bool = True) -> None:
        pass  # the engine loads its own model; /health tells when it is ready

    async def wait_ready(self, timeout_s: float) -> bool:
        """Wait until the engine answers /health (it may be loading its model for minutes)."""
        deadline = time.monotonic() + timeout_s
        while not self.engine_ready:
            if time.monotonic() > deadline:
                return False
            if self.process is not None and self.process.exits_unanswered >= GIVE_UP_AFTER_EXITS:
                return False  # an engine this node starts that keeps exiting before it answers: no use waiting
            self.poke()
            await asyncio.sleep(self.poll_s)
        return True

    async def identify(self) -> None:
        """An engine of kind "auto": which one it is, told by its /metrics series."""
        if self.kind != "auto":
            return
        assert self.session is not None, "start() opens the session first"
        url = self.engine_url + "/metrics"
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as response:
                kind = detect(await response.text())
        except _UNREACHABLE as exc:
            raise EngineMismatch(
                f"cannot tell which engine is at {self.engine_url}: {url} did not answer ({exc})"
            ) from None
        if kind is None:
            raise EngineMismatch(
                f"cannot tell which engine is at {self.engine_url}: {url} has no vllm:, sglang: or llamacpp: series. "
                f"Set --engine-kind (vllm, sglang or llamacpp), and start the engine with its metrics on "
                f"(llama-server: --metrics; SGLang: --enable-metrics)"
            )
        self.kind, self.dialect = kind, DIALECTS[kind]()

    async def probe(self) -> list[str]:
        """What about the engine keeps this node from serving through it; empty when nothing does."""
        assert self.session is not None, "start() opens the session first"
        problems: list[str] = []
        title, url = self.dialect.title, self.engine_url
        try:
            models = await self.dialect.served_models(self.session, url)
        except (*_UNREACHABLE, ValueError) as exc:
            models = []
            problems.append(f"{title} at {url} did not list its models at /v1/models ({exc.__class__.__name__}: {exc})")
        if models and not self.engine_model_given and self.engine_model not in models and self.model.key in models:
            self.engine_model = self.model.key  # served under the catalog's short name (--served-model-name)
        if models and self.engine_model not in models:
            problems.append(
                f"{title} at {url} serves {', '.join(models)}, not {self.engine_model!r}: "
                f"set --engine-model to the name it serves, or start it with the model this node registers"
            )
        try:
            async with self.session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as response:
                figures = self.dialect.figures(await response.text()) if response.status == 200 else {}
        except _UNREACHABLE:
            figures = {}
        for figure, advice in self.dialect.required.items():
            if figure not in figures:
                problems.append(f"{title}'s /metrics has no {figure} series: {advice}")
        if not problems:
            problems += await self._probe_token_ids()
        if not problems:
            self.verified = True
            self.poke()  # it serves from the next poll on
        return problems

    async def _probe_token_ids(self) -> list[str]:
        """One token generated: the stream must say its id, or the gateway could not resume anything."""
        req = parse(
            {"model": self.engine_model, "prompt": "Lifeline probe", "max_tokens": 1, "temperature": 0}, "completion"
        )
        try:
            seq = await self._submit(req, [], None)
            events = []
            while True:
                event = await asyncio.wait_for(seq.events.get(), timeout=60)
                events.append(event)
                if isinstance(event, FinishEvent):
                    break
        except (EngineError, ApiError, TimeoutError) as exc:
            return [f"{self.dialect.title} failed a one-token probe request: {exc}"]
        tokens = [e for e in events if isinstance(e, TokenEvent)]
        finish = events[-1]
        assert isinstance(finish, FinishEvent)
        if finish.reason == "error":
            return [f"{self.dialect.title} failed a one-token probe request: {(finish.detail or {}).get('reason')}"]
        if not tokens or any(t.token_id is None for t in tokens):
            need = {
                "vllm": "vLLM 0.10.2 or newer (return_token_ids)",
                "sglang": "SGLang with return_logprob in /generate",
                "llamacpp": "a llama-server with return_tokens in /completion",
            }[self.kind]
            return [f"{self.dialect.title}'s stream did not say its tokens' ids: Lifeline needs {need}"]
        return []

    # --- requests ----------------------------------------------------------------
    async def submit_request(self, req: CompletionRequest) -> Sequence:
        """Tokenize the prompt with the engine, then generate from its ids as a stream of token events."""
        return await self._submit(req, [], None)

    async def resume(
        self, req: CompletionRequest, generated: list[int], **_checkpoint_options
    ) -> tuple[Sequence, ResumeInfo]:
        """Continue a request another node was serving, by re-prefill: the prompt's ids, then the generated ones.

        A stock engine has no checkpoint to restore from: the holders and sources
        the gateway may name are not used (it names none for a node without the
        "checkpoint" capability).
        """
        if len(generated) >= req.params.max_tokens:
            raise EngineError(
                f"nothing left to generate: {len(generated)} of max_tokens={req.params.max_tokens} already sent",
                status=400,
            )
        started = time.monotonic()
        info = ResumeInfo("re-prefill", 0, 0, 0.0, reason="a real engine's KV cannot be restored: re-prefilled")
        seq = await self._submit(req, list(generated), info)
        info.reprefill_tokens = len(seq.prompt_ids) + len(generated)
        info.restore_ms = round((time.monotonic() - started) * 1000, 1)
        return seq, info

    async def _submit(self, req: CompletionRequest, generated: list[int], info: ResumeInfo | None) -> Sequence:
        if req.request_id in self.forwarded:
            raise EngineError(f"request id {req.request_id!r} is already running on this node", status=409)
        assert self.session is not None, "start() opens the session before the agent sends any request"
        self.counters["requests_proxied"] += 1
        try:
            prompt_ids = await self.dialect.prompt_ids(self.session, self.engine_url, self.engine_model, req)
            path, body = self.dialect.generation(self.engine_model, prompt_ids + generated, req, len(generated))
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
        seq = Sequence(req.request_id, prompt_ids, req.params, arrival=time.monotonic())
        seq.generated = list(generated)
        seq.resumed_with = len(generated)
        self.forwarded[req.request_id] = Forwarded(seq, len(prompt_ids) + len(generated))
        relay = asyncio.get_running_loop().create_task(self._relay(seq, req, upstream), name=f"relay-{req.request_id}")
        self._relays[req.request_id] = (relay, upstream)
        self._publish("arrival", req.request_id)  # the gateway's dispatch ledger settles on it (document 002)
        self.poke()
        return seq

    async def _refusal(self, upstream: aiohttp.ClientResponse) -> ApiError:
        """The engine's refusal, relayed in OpenAI's shape with its own status, message and field."""
        text = await upstream.text()
        try:
            error = json.loads(text)
            error = error.get("error", error)  # OpenAI's {"error": {...}}, or vLLM's older flat {"object": "error"}
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
        state: dict = {"logprobs": req.params.logprobs}
        try:
            async with upstream:
                async for data in _events(upstream):
                    if data is None:
                        break
                    chunk = self.dialect.read(data, state)
                    if chunk.error is not None:
                        reason, detail = "error", {"reason": f"the engine at {self.engine_url} failed: {chunk.error}"}
                        break
                    self._tokens(seq, chunk.pieces)
                    usage = {k: v for k, v in (chunk.usage or {}).items() if v is not None} or usage
                    reason = chunk.finish or reason
        except _UNREACHABLE as exc:
            reason, detail = (
                "error",
                {"reason": f"the engine at {self.engine_url} broke off the stream: {exc.__class__.__name__}"},
            )
            if seq.finished is None:  # not an abort of ours: the engine is likely gone
                self._engine_lost()
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            reason, detail = (
                "error",
                {"reason": f"the engine at {self.engine_url} sent a chunk this node cannot read: {exc!r}"},
            )
        if reason is None:
            reason, detail = "error", {"reason": f"the engine at {self.engine_url} ended the stream without a finish"}
        self._finish(seq, reason, detail, usage)

    def _tokens(self, seq: Sequence, pieces: list[Piece]) -> None:
        if not pieces:
            return
        now, wall = time.monotonic(), time.time()
        forwarded = self.forwarded.get(seq.request_id)
        if forwarded is not None:
            if forwarded.last_token_at is not None:
                gap = (now - forwarded.last_token_at) / len(pieces)
                self.step_s = gap if self.step_s is None else (1 - STEP_EWMA) * self.step_s + STEP_EWMA * gap
            first = forwarded.first_token_at is None
            forwarded.first_token_at = forwarded.first_token_at or now
            forwarded.last_token_at = now
        else:
            first = False
        # Sequence.generated is typed for the emulated engine's ids; here an id may be unknown (None).
        generated = cast("list[int | None]", seq.generated)
        last = len(pieces) - 1
        for i, piece in enumerate(pieces):
            if seq.first_token_at is None:
                seq.first_token_at = now
            generated.append(piece.token_id)
            seq.text += piece.text
            self.tokens_relayed += 1
            index = len(generated) - 1
            seq.events.put_nowait(
                TokenEvent(index, piece.token_id, piece.text, piece.logprob, piece.top, wall, piece.token, i < last)
            )
        if first:
            self._publish("admitted", seq.request_id)  # prefilled: it decodes now

    def abort(self, request_id: str) -> None:
        forwarded = self.forwarded.get(request_id)
        if forwarded is None:
            return
        relay = self._relays.pop(request_id, None)
        if relay is not None and relay[1] is not None:
            relay[1].close()  # the engine sees its client gone and aborts the request; the relay then ends
        self._finish(forwarded.seq, "abort")

    def _finish(self, seq: Sequence, reason: str, detail: dict | None = None, usage: dict | None = None) -> None:
        if seq.finished is not None:
            return
        seq.finished = reason
        forwarded = self.forwarded.pop(seq.request_id, None)
        self._relays.pop(seq.request_id, None)
        if reason == "error":
            self.counters["engine_errors"] += 1
            log.warning("%s: request %s failed: %s", self.name, seq.request_id, (detail or {}).get("reason"))
        # The engine's own counts where it gives them; else the prompt's ids and the tokens relayed.
        usage = usage or {}
        prompt = forwarded.prompt_tokens if forwarded else len(seq.prompt_ids)
        seq.events.put_nowait(
            FinishEvent(
                reason,
                int(usage.get("prompt_tokens") or prompt),
                len(seq.generated) if seq.resumed_with else int(usage.get("completion_tokens") or len(seq.generated)),
                time.time(),
                detail,
            )
        )
        self._publish("finished", seq.request_id)
        self.poke()

    # --- load: the engine's metrics and the adapter's own account -------------------------------
    async def _poll_loop(self, session: aiohttp.ClientSession) -> None:
        while True:
            await self._poll(session)
            try:
                # asyncio.timeout, not wait_for: wait_for swallows a cancellation that comes as the event is set
                # (Python 3.11), and stop() sets it (each abort pokes) just before it cancels this loop.
                async with asyncio.timeout(self.poll_s):
                    await self._poke.wait()
            except TimeoutError:
                pass
            self._poke.clear()

    async def _poll(self, session: aiohttp.ClientSession) -> None:
        try:
            async with session.get(self.engine_url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as health:
                self.engine_ready = health.status == 200
            if self.engine_ready and self.process is not None:
                self.process.answered()
            state = "serving" if self.engine_ready and self.verified else "loading_full"
            async with session.get(self.engine_url + "/metrics", timeout=aiohttp.ClientTimeout(total=2)) as response:
                figures = self.dialect.figures(await response.text())
        except _UNREACHABLE as exc:
            self.counters["poll_failures"] += 1
            self.engine_ready = False
            if self.model_state == "serving":
                log.warning("engine at %s stopped answering: %s", self.engine_url, exc)
            state, figures = "loading_full", {}
        changed = state != self.model_state or any(
            figures.get(k) != self.figures.get(k) for k in ("running", "waiting", "kv_usage")
        )
        now = time.monotonic()
        if self.last_poll_at is not None and (figures.get("running") or self.forwarded):
            self.busy_s += now - self.last_poll_at
        self.last_poll_at = now
        self.model_state, self.figures = state, figures
        for key in ("generation_tokens", "prompt_tokens", "preemptions"):
            if key in figures:
                self.counters[key] = figures[key]
        self.used_blocks = self._used_blocks()
        if changed or self.forwarded:  # while requests run, the gateway sees their progress each poll
            self.publish("engine_metrics")

    def _used_blocks(self) -> int:
        if "kv_usage" in self.figures:
            return int(self.figures["kv_usage"] * self.deployment.kv_blocks)
        return sum(math.ceil((f.prompt_tokens + len(f.seq.generated)) / BLOCK_TOKENS) for f in self.forwarded.values())

    def _engine_lost(self) -> None:
        """A stream broke: until /health says otherwise, the engine serves nothing, and the gateway hears so now
        (not at the next poll), before the requests it moves could be sent back here."""
        if self.model_state == "serving":
            self.engine_ready = False
            self.model_state = "loading_full"
            self.publish("engine_lost")
        self.poke()

    def poke(self) -> None:
        """Read the engine's metrics now: a request started or ended."""
        self._poke.set()

    def status(self) -> NodeStatus:
        f = self.figures
        prefilling = [r for r in self.forwarded.values() if r.first_token_at is None]
        decoding = [r for r in self.forwarded.values() if r.first_token_at is not None]
        own = len(self.forwarded)
        # The engine's counts where it exports them (they include requests from other clients);
        # never fewer than the requests this node itself has in flight there.
        running = max(int(f["running"]), own) if "running" in f else own
        step_ms = None if self.step_s is None else round(self.step_s * 1000, 3)
        return NodeStatus(
            seq=self.status_seq,
            at=time.time(),
            model_state=self.model_state,
            load_progress=1.0 if self.model_state == "serving" else None,
            waiting=int(f["waiting"]) if "waiting" in f else None,
            running=running,
            uncomputed_prefill_tokens=sum(r.prompt_tokens for r in prefilling),
            decode_batch=len(decoding),
            decode_context_tokens=sum(r.prompt_tokens + len(r.seq.generated) - r.seq.resumed_with for r in decoding),
            kv_blocks_used=self._used_blocks(),
            kv_blocks_total=self.deployment.kv_blocks,
            checkpoint_bytes_held=None,
            checkpoint_budget_bytes=None,
            checkpoint_requests=None,
            step_ms=step_ms,
            steps=self.tokens_relayed,
            time_scale=None,
            decode_step_ms=step_ms,
            decode_step_batch=len(decoding) if step_ms is not None else None,
            decode_step_context_tokens=None,
            batch_limit=None,
            batch_factor=None,
            assist=None,
            in_flight=own,
            source="engine_metrics",
        )

    def subscribe(self) -> asyncio.Queue:
        return self._feed.subscribe()

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        self._feed.unsubscribe(queue)

    def publish(self, reason: str) -> None:
        self._publish(reason)

    def _publish(self, reason: str, request_id: str | None = None) -> None:
        self.status_seq += 1
        if reason == "finished" and request_id is not None:
            self._feed.finished(request_id)
        if not self._feed:
            return
        status = {**self.status().to_json(), "reason": reason}
        if request_id is not None:
            status["request_id"] = request_id
        self._feed.publish(status, self.forwarded)  # a subscriber that lost statuses gets the request ids with it


YIELD_EVERY = 16  # events relayed between two turns of the event loop given to the node's other work


async def _events(upstream: aiohttp.ClientResponse) -> AsyncIterator[dict | None]:
    """The JSON objects of a server-sent event stream; None at `[DONE]`.

    A line already buffered is read without a turn of the event loop, so an engine that decodes faster than the
    relay (vLLM on a tiny model: a 1,500-token reply in about 4 s) would hold the loop for the whole reply: the
    agent answered no status, health probe or heartbeat for 3-5 s (its loop lag). Every YIELD_EVERY events the
    loop gets a turn.
    """
    relayed = 0
    async for line in upstream.content:
        if not line.startswith(b"data:"):
            continue
        relayed += 1
        if relayed % YIELD_EVERY == 0:
            await asyncio.sleep(0)
        data = line[5:].strip()
        if data == b"[DONE]":
            yield None
            return
        chunk = json.loads(data)
        if not isinstance(chunk, dict):
            raise ValueError(f"a chunk is {type(chunk).__name__}, not an object")
        yield chunk
