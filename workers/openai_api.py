"""The OpenAI completions and chat completions API over the engine.

Request parsing names the offending field the way OpenAI does (400 with
`param`), and responses follow the OpenAI shapes closely enough that the
official `openai` client works unchanged. Lifeline's own protocol rides in an
extension object, `lifeline`, that OpenAI clients send through `extra_body`.
"""

import json
import secrets
import time
from dataclasses import dataclass

from aiohttp import web

from workers import tokens
from workers.checkpoint import Peer
from workers.engine import FinishEvent, SamplingParams, TokenEvent


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind
        self.code = code

    def response(self, headers: dict | None = None) -> web.Response:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return web.json_response(body, status=self.status, headers=headers)


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


async def read_json(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError(400, "The body is not valid JSON.", param="body") from None
    if not isinstance(body, dict):
        raise ApiError(400, "The body must be a JSON object.", param="body")
    return body


@dataclass
class Resume:
    """Continue a request whose first len(generated) output tokens the client already has."""

    generated: list[int]
    sources: tuple[Peer, ...]  # holders that may have its KV pages


@dataclass
class Extension:
    """Lifeline's protocol, in the request's `lifeline` object (`extra_body` for OpenAI clients)."""

    holders: tuple[Peer, ...] = ()  # stream this request's KV pages to these nodes
    checkpoint_prefill_chunks: bool = False  # stream prompt blocks as prefill chunks complete
    resume: Resume | None = None
    return_token_ids: bool = False  # each chunk carries the ids of its tokens

    @classmethod
    def parse(cls, data) -> "Extension":
        if not isinstance(data, dict):
            raise bad("lifeline", "must be an object")
        try:
            holders = tuple(Peer.parse(h, f"lifeline.holders[{i}]") for i, h in enumerate(_list(data, "holders")))
            resume = None
            if data.get("resume") is not None:
                raw = data["resume"]
                if not isinstance(raw, dict):
                    raise ValueError("lifeline.resume: must be an object")
                generated = raw.get("generated_token_ids")
                if not isinstance(generated, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in generated):
                    raise ValueError("lifeline.resume.generated_token_ids: must be a list of token ids the client already has")
                sources = tuple(Peer.parse(h, f"lifeline.resume.sources[{i}]") for i, h in enumerate(_list(raw, "sources", "lifeline.resume.")))
                resume = Resume(generated, sources)
        except ValueError as exc:
            field, _, message = str(exc).partition(": ")
            raise bad(field, message) from None
        if len(holders) > 2:
            raise bad("lifeline.holders", "at most two holders")
        return cls(holders, bool(data.get("checkpoint_prefill_chunks")), resume, bool(data.get("return_token_ids")))


def _list(data: dict, key: str, prefix: str = "lifeline.") -> list:
    value = data.get(key) or []
    if not isinstance(value, list):
        raise ValueError(f"{prefix}{key}: must be a list")
    return value


@dataclass
class CompletionRequest:
    kind: str  # "completion" or "chat"
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    request_id: str
    extension: Extension


def _int(body: dict, key: str, default, low: int, high: int | None = None):
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(key, f"must be an integer, got {type(value).__name__}")
    if value < low or high is not None and value > high:
        raise bad(key, f"must be between {low} and {high}" if high is not None else f"must be at least {low}")
    return value


def _float(body: dict, key: str, default: float, low: float, high: float) -> float:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(key, f"must be a number, got {type(value).__name__}")
    if not low <= value <= high:
        raise bad(key, f"must be between {low} and {high}")
    return float(value)


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise bad("stop", "must be a non-empty string or a list of at most 4 non-empty strings")
    return tuple(stop)


def _chat_text(messages) -> str:
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list of {role, content} objects")
    parts = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad(f"messages[{i}]", "must be an object with role and content")
        role = message.get("role")
        if role not in ("system", "user", "assistant", "tool", "developer"):
            raise bad(f"messages[{i}].role", f"{role!r} is not a role: expected system, user, assistant, tool or developer")
        content = message.get("content")
        if isinstance(content, list):
            texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            content = " ".join(texts)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content", "must be a string or a list of text parts")
        parts.append(f"<|{role}|> {content}")
    return "\n".join(parts) + "\n<|assistant|>"


def parse(body: dict, kind: str, served: set[str], model_key: str) -> CompletionRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "is required")
    if model not in served:
        raise ApiError(404, f"The model `{model}` does not exist on this node: it serves {model_key}.", param="model", code="model_not_found")
    if body.get("n", 1) != 1:
        raise bad("n", "only n=1 is supported")
    if kind == "completion":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt.strip():
            raise bad("prompt", "must be a non-empty string")
        if body.get("echo"):
            raise bad("echo", "is not supported")
        logprobs = _int(body, "logprobs", None, 0, 5)
        max_tokens = _int(body, "max_tokens", 16, 1, 32768)
        text = prompt
    else:
        text = _chat_text(body.get("messages"))
        logprobs = None
        if body.get("logprobs"):
            logprobs = _int(body, "top_logprobs", 0, 0, 20)
        elif body.get("top_logprobs") is not None:
            raise bad("top_logprobs", "needs logprobs set to true")
        max_tokens = _int(body, "max_completion_tokens", None, 1, 32768) or _int(body, "max_tokens", 512, 1, 32768)
    temperature = _float(body, "temperature", 1.0, 0.0, 2.0)
    seed = _int(body, "seed", None, -(2**63), 2**63 - 1)
    if seed is None:
        # Sampling without a seed still needs one fixed for the request's life,
        # so that a migrated request continues the same text.
        seed = secrets.randbits(62) if temperature > 0 else 0
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream", "must be true or false")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad("ignore_eos", "must be true or false")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise bad("stream_options", "must be an object")
    raw_extension = body.get("lifeline") or {}
    extension = Extension.parse(raw_extension)
    request_id = raw_extension.get("request_id")
    if request_id is not None and (not isinstance(request_id, str) or not 1 <= len(request_id) <= 128):
        raise bad("lifeline.request_id", "must be a string of 1 to 128 characters")
    prompt_ids = tokens.encode(text)
    if not prompt_ids:
        raise bad("prompt" if kind == "completion" else "messages", "has no tokens")
    return CompletionRequest(
        kind=kind,
        model=model,
        prompt_ids=prompt_ids,
        params=SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, stop=_stop(body), logprobs=logprobs, ignore_eos=ignore_eos),
        stream=stream,
        include_usage=bool(stream_options.get("include_usage")),
        request_id=request_id or ("cmpl-" if kind == "completion" else "chatcmpl-") + secrets.token_hex(12),
        extension=extension,
    )


def usage(finish: FinishEvent) -> dict:
    return {
        "prompt_tokens": finish.prompt_tokens,
        "completion_tokens": finish.completion_tokens,
        "total_tokens": finish.prompt_tokens + finish.completion_tokens,
    }


def _completion_logprobs(event: TokenEvent, offset: int) -> dict:
    return {
        "tokens": [tokens.token_text(event.token_id)],
        "token_logprobs": [event.logprob],
        "top_logprobs": [{tokens.token_text(t): lp for t, lp in event.top}],
        "text_offset": [offset],
    }


def _chat_logprobs(event: TokenEvent) -> dict:
    word = tokens.token_text(event.token_id)
    return {
        "content": [
            {
                "token": word,
                "logprob": event.logprob,
                "bytes": list(word.encode()),
                "top_logprobs": [
                    {"token": tokens.token_text(t), "logprob": lp, "bytes": list(tokens.token_text(t).encode())} for t, lp in event.top
                ],
            }
        ]
    }


class ChunkWriter:
    """Builds the OpenAI JSON for each step of one request."""

    def __init__(self, req: CompletionRequest, model_name: str):
        self.req = req
        self.model = model_name
        self.created = int(time.time())
        self.offset = 0
        # The common chunk (a token, no logprobs, no extension) is rendered from a template:
        # it is written once per token per stream, and a dict plus json.dumps costs several times more.
        head = f'data: {{"id":{json.dumps(req.request_id)},"object":"%s","created":{self.created},"model":{json.dumps(model_name)},"choices":[{{"index":0,'
        self._fast = req.params.logprobs is None and not req.extension.return_token_ids
        if req.kind == "completion":
            self._first = self._next = (head % "text_completion") + '"text":'
            self._tail = ',"logprobs":null,"finish_reason":null}]}\n\n'
        else:
            self._first = (head % "chat.completion.chunk") + '"delta":{"role":"assistant","content":'
            self._next = (head % "chat.completion.chunk") + '"delta":{"content":'
            self._tail = '},"logprobs":null,"finish_reason":null}]}\n\n'

    def token_sse(self, event: TokenEvent, first: bool, extension: dict | None = None) -> bytes:
        """The SSE bytes for one token."""
        if self._fast and not extension:
            self.offset += len(event.text)
            return ((self._first if first else self._next) + json.dumps(event.text) + self._tail).encode()
        return sse(self.token_chunk(event, first, extension))

    def _envelope(self, choice: dict, obj: str) -> dict:
        return {"id": self.req.request_id, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}

    def token_chunk(self, event: TokenEvent, first: bool, extension: dict | None = None) -> dict:
        want_logprobs = self.req.params.logprobs is not None
        if self.req.kind == "completion":
            choice = {
                "index": 0,
                "text": event.text,
                "logprobs": _completion_logprobs(event, self.offset) if want_logprobs else None,
                "finish_reason": None,
            }
            self.offset += len(event.text)
            obj = "text_completion"
        else:
            delta = {"role": "assistant", "content": event.text} if first else {"content": event.text}
            choice = {"index": 0, "delta": delta, "logprobs": _chat_logprobs(event) if want_logprobs else None, "finish_reason": None}
            obj = "chat.completion.chunk"
        if self.req.extension.return_token_ids:
            choice["token_ids"] = [event.token_id]  # as vLLM's return_token_ids
        chunk = self._envelope(choice, obj)
        if extension:
            chunk["lifeline"] = extension
        return chunk

    def finish_chunk(self, reason: str | None) -> dict:
        if self.req.kind == "completion":
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": reason}
            return self._envelope(choice, "text_completion")
        return self._envelope({"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason}, "chat.completion.chunk")

    def usage_chunk(self, finish: FinishEvent) -> dict:
        obj = "text_completion" if self.req.kind == "completion" else "chat.completion.chunk"
        return {"id": self.req.request_id, "object": obj, "created": self.created, "model": self.model, "choices": [], "usage": usage(finish)}

    def whole(self, events: list[TokenEvent], finish: FinishEvent) -> dict:
        text = "".join(e.text for e in events)
        want_logprobs = self.req.params.logprobs is not None
        if self.req.kind == "completion":
            logprobs = None
            if want_logprobs:
                logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                offset = 0
                for e in events:
                    part = _completion_logprobs(e, offset)
                    offset += len(e.text)
                    for key in logprobs:
                        logprobs[key].extend(part[key])
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish.reason}
            body = self._envelope(choice, "text_completion")
        else:
            logprobs = {"content": [c for e in events for c in _chat_logprobs(e)["content"]]} if want_logprobs else None
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish.reason}
            body = self._envelope(choice, "chat.completion")
        body["usage"] = usage(finish)
        return body


def sse(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()
