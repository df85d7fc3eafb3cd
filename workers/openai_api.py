"""The OpenAI completions and chat completions answers, built from the engine's events.

Requests are validated by workers.openai_schema, the one schema the gateway
shares; responses follow the OpenAI shapes closely enough that the official
`openai` client works unchanged. Lifeline's own protocol rides in an
extension object, `lifeline`, that OpenAI clients send through `extra_body`.
"""

import asyncio
import json
import logging
import time
from typing import Any

from aiohttp import web

from workers import tokens
from workers.engine_api import FinishEvent, TokenEvent
from workers.openai_schema import ApiError, CompletionRequest


def error_response(error: ApiError, headers: dict | None = None) -> web.Response:
    return web.json_response(error.to_json(), status=error.status, headers=headers)


def json_errors(server: str, log: logging.Logger):
    """An aiohttp middleware for `server` (the node, the gateway): every refusal and every failure answers JSON in
    OpenAI's shape, a 404, a 405 with its Allow header, a 500 whose traceback goes to `log`."""

    @web.middleware
    async def middleware(request: web.Request, handler):
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
            kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
            return error_response(
                ApiError(exc.status, f"{exc.reason}: {request.method} {request.path}", kind=kind), headers
            )
        except ApiError as exc:  # a refusal raised past its handler (read_json), answered as it says
            return error_response(exc)
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            message = f"The {server} failed on {request.method} {request.path}; its log has the traceback."
            return error_response(ApiError(500, message, kind="server_error"))

    return middleware


async def read_json(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError(400, "The body is not valid JSON.", param="body") from None
    except RecursionError:
        raise ApiError(400, "The body nests too deeply to be a request.", param="body") from None
    if not isinstance(body, dict):
        raise ApiError(400, "The body must be a JSON object.", param="body")
    return body


def usage(finish: FinishEvent) -> dict:
    return {
        "prompt_tokens": finish.prompt_tokens,
        "completion_tokens": finish.completion_tokens,
        "total_tokens": finish.prompt_tokens + finish.completion_tokens,
    }


def _spelling(token: int | str | None, previous: int | None) -> str:
    """A token as logprobs name it: the text it adds after `previous` (workers.tokens spaces and capitalises prose),
    so that a choice's tokens joined are its text, as the OpenAI API promises; or as a real engine spelled it."""
    if isinstance(token, str):
        return token
    return "" if token is None else tokens.piece(token, previous)


def _sampled(event: TokenEvent, previous: int | None) -> str:
    return _spelling(event.token if event.token is not None else event.token_id, previous)


def _completion_logprobs(event: TokenEvent, offset: int, previous: int | None) -> dict:
    return {
        "tokens": [_sampled(event, previous)],
        "token_logprobs": [event.logprob],
        "top_logprobs": [{_spelling(t, previous): lp for t, lp in event.top}],
        "text_offset": [offset],
    }


def _chat_logprobs(event: TokenEvent, previous: int | None) -> dict[str, Any]:
    word = _sampled(event, previous)
    top = [(_spelling(t, previous), lp) for t, lp in event.top]
    return {
        "content": [
            {
                "token": word,
                "logprob": event.logprob,
                "bytes": list(word.encode()),
                "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in top],
            }
        ],
        "refusal": None,  # OpenAI's schema requires both lists; this engine never refuses
    }


class ChunkWriter:
    """Builds the OpenAI JSON for each step of one request."""

    def __init__(self, req: CompletionRequest, model_name: str):
        self.req = req
        self.model = model_name
        self.created = int(time.time())
        self.offset = 0
        # As vLLM does, the text that may be the start of a stop string is held back until the next token says: a
        # stop string that spans tokens is cut from the answer whole, never half-written ("time" then ",", for
        # "time,"). One character or none needs no holding: the engine cuts it within its token.
        self._hold = max((len(s) for s in req.params.stop), default=1) - 1
        self._text = ""  # every token's text so far, as the engine gave it (only kept while holding back)
        self._written = 0  # how much of it went out
        self._last: TokenEvent | None = None
        self._previous: int | None = None  # the token before the last: how workers.tokens spaces the last
        self._before: int | None = None  # the token before the one being written: how its logprobs spell it
        # The common chunk (a token, no logprobs, no extension) is rendered from a template:
        # it is written once per token per stream, and a dict plus json.dumps costs several times more.
        head = (
            f'data: {{"id":{json.dumps(req.request_id)},"object":"%s","created":{self.created},'
            f'"model":{json.dumps(model_name)},"choices":[{{"index":0,'
        )
        self._fast = req.params.logprobs is None and not req.extension.return_token_ids
        if req.kind == "completion":
            self._first = self._next = (head % "text_completion") + '"text":'
            self._tail = ',"logprobs":null,"finish_reason":null}]}\n\n'
        else:
            self._first = (head % "chat.completion.chunk") + '"delta":{"role":"assistant","refusal":null,"content":'
            self._next = (head % "chat.completion.chunk") + '"delta":{"content":'
            self._tail = '},"logprobs":null,"finish_reason":null}]}\n\n'

    def resumed(self, generated: list[int]) -> None:
        """The stream continues one whose client has these tokens, all but the text held back from it."""
        if self._hold:
            self._text = tokens.decode(generated)
            self._written = max(0, len(self._text) - self._hold)
            self._last = None
            self._previous = generated[-1] if generated else None
        self._before = generated[-1] if generated else None

    def _take(self, event: TokenEvent) -> str:
        """The text to write with this token's chunk."""
        if not self._hold:
            return event.text
        if self._last is not None:
            self._previous = self._last.token_id
        self._last = event
        self._text += event.text
        written, self._written = self._written, max(self._written, len(self._text) - self._hold)
        return self._text[written : self._written]

    def _rest(self, reason: str | None) -> str:
        """The text held back, written with the finish: cut where a stop string begins that the last token ended."""
        if not self._hold:
            return ""
        final, last = self._text, self._last
        if reason == "stop" and last is not None and last.token is None and last.token_id is not None:
            # The emulated engine gave the last token only the text before the stop string: if the string began in
            # tokens already taken, it is found again here, where the engine found it.
            base = self._text[: len(self._text) - len(last.text)]
            combined = base + tokens.piece(last.token_id, self._previous)
            for stop in self.req.params.stop:
                cut = combined.find(stop, max(0, len(base) - len(stop) + 1))
                if cut >= 0:
                    final = combined[:cut]
                    break
        rest = final[self._written :]
        self._written = max(self._written, len(final))
        return rest

    def token_sse(self, event: TokenEvent, first: bool, extension: dict | None = None) -> bytes:
        """The SSE bytes for one token."""
        if self._fast and not extension:
            self.offset += len(event.text)
            text = self._take(event)
            return ((self._first if first else self._next) + json.dumps(text) + self._tail).encode()
        return sse(self.token_chunk(event, first, extension))

    def tokens_sse(self, events: list[TokenEvent], first: bool, extension: dict | None = None) -> bytes:
        """The SSE bytes for tokens an engine sent in one chunk: one chunk, as the engine's (vLLM's shape: its
        `token_ids` and logprobs list every token, its text is theirs together)."""
        if len(events) == 1:
            return self.token_sse(events[0], first, extension)
        chunks = [self.token_chunk(e, first and i == 0, extension if i == 0 else None) for i, e in enumerate(events)]
        merged, choice = chunks[0], chunks[0]["choices"][0]
        for later in (c["choices"][0] for c in chunks[1:]):
            if "text" in choice:
                choice["text"] += later["text"]
            else:
                choice["delta"]["content"] += later["delta"]["content"]
            if "token_ids" in choice:
                choice["token_ids"] += later["token_ids"]
            if choice["logprobs"] is not None:
                for key, values in later["logprobs"].items():
                    if isinstance(values, list):
                        choice["logprobs"][key] += values
        return sse(merged)

    def _envelope(self, choice: dict, obj: str) -> dict:
        return {
            "id": self.req.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    def token_chunk(self, event: TokenEvent, first: bool, extension: dict | None = None) -> dict:
        want_logprobs = self.req.params.logprobs is not None
        text = self._take(event)
        before, self._before = self._before, event.token_id
        if self.req.kind == "completion":
            choice = {
                "index": 0,
                "text": text,
                "logprobs": _completion_logprobs(event, self.offset, before) if want_logprobs else None,
                "finish_reason": None,
            }
            self.offset += len(event.text)
            obj = "text_completion"
        else:
            delta = {"role": "assistant", "refusal": None, "content": text} if first else {"content": text}
            choice = {
                "index": 0,
                "delta": delta,
                "logprobs": _chat_logprobs(event, before) if want_logprobs else None,
                "finish_reason": None,
            }
            obj = "chat.completion.chunk"
        if self.req.extension.return_token_ids:
            # As vLLM's return_token_ids; none for a token whose id a real engine did not say.
            choice["token_ids"] = [event.token_id] if event.token_id is not None else []
        chunk = self._envelope(choice, obj)
        if extension:
            chunk["lifeline"] = extension
        return chunk

    def finish_chunk(self, reason: str | None) -> dict:
        """The last chunk, with the text held back; None: the stream moves to another node, which writes that."""
        rest = self._rest(reason) if reason is not None else ""
        if self.req.kind == "completion":
            choice = {"index": 0, "text": rest, "logprobs": None, "finish_reason": reason}
            return self._envelope(choice, "text_completion")
        return self._envelope(
            {"index": 0, "delta": {"content": rest} if rest else {}, "logprobs": None, "finish_reason": reason},
            "chat.completion.chunk",
        )

    def usage_chunk(self, finish: FinishEvent) -> dict:
        obj = "text_completion" if self.req.kind == "completion" else "chat.completion.chunk"
        return {
            "id": self.req.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage(finish),
        }

    def whole(self, events: list[TokenEvent], finish: FinishEvent) -> dict:
        text = "".join(self._take(e) for e in events) + self._rest(finish.reason)
        want_logprobs = self.req.params.logprobs is not None
        if self.req.kind == "completion":
            logprobs: dict[str, Any] | None = None
            if want_logprobs:
                logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                offset, before = 0, None
                for e in events:
                    part = _completion_logprobs(e, offset, before)
                    offset, before = offset + len(e.text), e.token_id
                    for key in logprobs:
                        logprobs[key].extend(part[key])
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish.reason}
            body = self._envelope(choice, "text_completion")
        else:
            logprobs = (
                {
                    "content": [
                        c
                        for e, before in zip(events, [None] + [e.token_id for e in events[:-1]])
                        for c in _chat_logprobs(e, before)["content"]
                    ],
                    "refusal": None,
                }
                if want_logprobs
                else None
            )
            message = {"role": "assistant", "content": text, "refusal": None}
            choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish.reason}
            body = self._envelope(choice, "chat.completion")
        body["usage"] = usage(finish)
        return body


def sse(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()
