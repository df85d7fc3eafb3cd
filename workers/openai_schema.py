"""The OpenAI completions and chat completions request: one schema, for the gateway and the node.

The gateway validates every request with this module before it books a node
or a checkpoint holder, and the node validates what it is sent with the same
code; so a request the gateway lets through is one every node accepts, and a
bad one is refused once, at the door, with a 400 that names the field (as
OpenAI does, `param` set) instead of failing on a node.

What the emulated engine can do with a parameter decides its fate. Honoured:
temperature, top_p, seed, stop, max_tokens, logprobs (up to 20), n=1, stream
and its usage chunk, vLLM's top_k, min_p, min_tokens and ignore_eos, and tools
offered with tool_choice auto or none (written into the prompt, as a chat
template writes them; the model answers in text, as a model may). Accepted
because they do not change the output: user, metadata, safety_identifier,
prompt_cache_key, prompt_cache_retention, prediction, parallel_tool_calls.
Everything else that would change the output (JSON mode, a forced tool call,
penalties, logit bias, images, audio, web search, reasoning effort) is refused
with a 400 saying so; it is never dropped in silence. A field the API does not
have is refused too, as OpenAI refuses it.
"""

import json
import re
import secrets
from dataclasses import dataclass, field

from workers import tokens
from workers.checkpoint import Peer
from workers.core import SamplingParams

MAX_STOP = 4
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's own limit
DEFAULT_CHAT_MAX_TOKENS = 512
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DOCUMENT_START = "<|endoftext|>"  # the completions API's default prompt
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:~-]{1,128}$")
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class ApiError(Exception):
    """A refusal in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind
        self.code = code

    def to_json(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(param: str, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code=code)


def unsupported(param: str, message: str) -> ApiError:
    return bad(param, message, code="unsupported_parameter")


@dataclass
class Resume:
    """Continue a request whose first len(generated) output tokens the client already has."""

    generated: list[int]
    sources: tuple[Peer, ...]  # holders that may have its KV pages


@dataclass
class Extension:
    """Lifeline's protocol, in the request's `lifeline` object (`extra_body` for OpenAI clients)."""

    request_id: str | None = None
    holders: tuple[Peer, ...] = ()  # stream this request's KV pages to these nodes
    checkpoint_prefill_chunks: bool = False  # stream prompt blocks as prefill chunks complete
    resume: Resume | None = None
    return_token_ids: bool = False  # each chunk carries the ids of its tokens
    # Take over the stream of a request this node holds since its gateway went away: the client has its first
    # `attach` output tokens (a gateway that resumes a stream from Last-Event-ID; workers.agent's parking).
    attach: int | None = None

    @classmethod
    def parse(cls, data) -> "Extension":
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise bad("lifeline", "must be an object")
        known = {"request_id", "holders", "checkpoint_prefill_chunks", "resume", "return_token_ids", "attach"}
        for key in data:
            if key not in known:
                raise bad(f"lifeline.{key}", f"is not part of Lifeline's protocol: expected {', '.join(sorted(known))}")
        request_id = data.get("request_id")
        if request_id is not None and (not isinstance(request_id, str) or not REQUEST_ID.match(request_id)):
            raise bad("lifeline.request_id", "must be 1 to 128 letters, digits or . _ : ~ -")
        try:
            holders = tuple(Peer.parse(h, f"lifeline.holders[{i}]") for i, h in enumerate(_list(data, "holders")))
            resume = None
            if data.get("resume") is not None:
                raw = data["resume"]
                if not isinstance(raw, dict):
                    raise ValueError("lifeline.resume: must be an object")
                generated = raw.get("generated_token_ids")
                if not isinstance(generated, list) or not all(_is_int(t) and t >= 0 for t in generated):
                    raise ValueError(
                        "lifeline.resume.generated_token_ids: must be a list of token ids the client already has"
                    )
                sources = tuple(
                    Peer.parse(h, f"lifeline.resume.sources[{i}]")
                    for i, h in enumerate(_list(raw, "sources", "lifeline.resume."))
                )
                resume = Resume([int(t) for t in generated], sources)
        except ValueError as exc:
            where, _, message = str(exc).partition(": ")
            raise bad(where, message) from None
        if len(holders) > 2:
            raise bad("lifeline.holders", "at most two holders")
        attach = data.get("attach")
        if attach is not None:
            if not _is_int(attach) or attach < 0:
                raise bad("lifeline.attach", "must be the number of output tokens the client already has (0 or more)")
            if request_id is None or resume is not None:
                raise bad("lifeline.attach", "needs lifeline.request_id, and cannot go with lifeline.resume")
        return cls(
            request_id,
            holders,
            _bool(data, "checkpoint_prefill_chunks", "lifeline."),
            resume,
            _bool(data, "return_token_ids", "lifeline."),
            None if attach is None else int(attach),
        )


@dataclass
class CompletionRequest:
    kind: str  # "completion" or "chat"
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    request_id: str
    extension: Extension = field(default_factory=Extension)
    # The body as the client sent it: what an adapter passes on to the real engine it fronts.
    body: dict = field(default_factory=dict, repr=False)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


# --- the fields ---------------------------------------------------------------------------------
COMMON = {
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "seed",
    "stop",
    "user",
    "logit_bias",
    "frequency_penalty",
    "presence_penalty",
    "lifeline",
    # vLLM's sampling extras, which OpenAI-compatible clients send through extra_body
    "top_k",
    "min_p",
    "min_tokens",
    "ignore_eos",
    "repetition_penalty",
    # vLLM's: each chunk carries the ids of its tokens, as lifeline.return_token_ids
    "return_token_ids",
}
CHAT = COMMON | {
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "modalities",
    "audio",
    "prediction",
    "reasoning_effort",
    "verbosity",
    "web_search_options",
    "store",
    "metadata",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
}
COMPLETION = COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"}
# What the routers people put in front of vLLM and SGLang add to every request they forward (vllm-router and
# sglang-router write SGLang's and vLLM's extras with their default values): accepted at exactly those values, which
# change nothing here; any other value is refused with a 400 that names the field.
ROUTER_DEFAULTS = {
    "no_stop_trim": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
    "include_reasoning": True,
}


def _is_int(value) -> bool:
    """An integer as JSON Schema means it: 16 and 16.0 both (a client's JSON library may write either)."""
    if isinstance(value, float):
        return value.is_integer()
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _list(data: dict, key: str, prefix: str = "lifeline.") -> list:
    value = data.get(key) or []
    if not isinstance(value, list):
        raise ValueError(f"{prefix}{key}: must be a list")
    return value


def _bool(body: dict, key: str, prefix: str = "") -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(prefix + key, f"must be true or false, got {_kind(value)}")
    return value


def _kind(value) -> str:
    if value is None:
        return "null"
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "an object",
    }.get(type(value), type(value).__name__)


def _int(body: dict, key: str, default, low: int, high: int | None = None):
    value = body.get(key)
    if value is None:
        return default
    if not _is_int(value):
        raise bad(key, f"must be an integer, got {_kind(value)}")
    value = int(value)
    if value < low or high is not None and value > high:
        raise bad(
            key,
            f"must be between {low} and {high}, got {value}"
            if high is not None
            else f"must be at least {low}, got {value}",
        )
    return value


def _float(body: dict, key: str, default: float, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if not _is_number(value):
        raise bad(key, f"must be a number, got {_kind(value)}")
    if not low <= value <= high:
        raise bad(key, f"must be between {low:g} and {high:g}, got {value}")
    return float(value)


def _text(value, param: str) -> str:
    """A string that is valid Unicode: JSON lets a lone surrogate through (\\udfff), UTF-8 does not."""
    if not isinstance(value, str):
        raise bad(param, f"must be a string, got {_kind(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad(
            param,
            f"holds a lone surrogate (U+{ord(value[exc.start]):04X}) at character {exc.start}: "
            "it is not valid Unicode text; "
            "send UTF-8 text, with a character outside the BMP as one \\U escape or a surrogate pair",
        ) from None
    return value


def _object(body: dict, key: str) -> dict | None:
    value = body.get(key)
    if value is not None and not isinstance(value, dict):
        raise bad(key, f"must be an object, got {_kind(value)}")
    return value


def _neutral(body: dict, key: str, low: float, high: float, neutral: float, what: str) -> None:
    """A parameter the engine can only take at its neutral value."""
    value = _float(body, key, neutral, low, high)
    if value != neutral:
        raise unsupported(key, f"{what} is not supported by this engine; send {neutral:g} or leave it out")


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not stop or len(stop) > MAX_STOP:
        raise bad("stop", f"must be a string or a list of 1 to {MAX_STOP} strings")
    for i, item in enumerate(stop):
        if not _text(item, f"stop[{i}]" if isinstance(body["stop"], list) else "stop"):
            raise bad(f"stop[{i}]" if isinstance(body["stop"], list) else "stop", "must not be empty")
    return tuple(stop)


# --- chat messages ---------------------------------------------------------------------------------
def _content_text(content, param: str, *, allow_refusal: bool = False) -> str:
    """A message's content, a string or a list of parts, as text; anything but text is refused."""
    if isinstance(content, str):
        return _text(content, param)
    if not isinstance(content, list) or not content:
        raise bad(param, f"must be a string or a non-empty list of content parts, got {_kind(content)}")
    texts = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise bad(
                where, f'must be a content part object such as {{"type": "text", "text": "..."}}, got {_kind(part)}'
            )
        kind = part.get("type")
        if kind == "text":
            texts.append(_text(part.get("text"), where + ".text"))
        elif kind == "refusal" and allow_refusal:
            texts.append(_text(part.get("refusal"), where + ".refusal"))
        elif kind in ("image_url", "input_audio", "file"):
            raise unsupported(where, f"{kind} parts are not supported: the models this cluster serves read text only")
        else:
            raise bad(where + ".type", f"{kind!r} is not a content part type: expected text")
    return " ".join(texts)


def _tool_calls_text(calls, param: str) -> str:
    if not isinstance(calls, list):
        raise bad(param, f"must be a list of tool calls, got {_kind(calls)}")
    rendered = []
    for j, call in enumerate(calls):
        where = f"{param}[{j}]"
        if not isinstance(call, dict):
            raise bad(where, f"must be an object, got {_kind(call)}")
        _text(call.get("id"), where + ".id")
        function = call.get("function") if call.get("type", "function") == "function" else call.get("custom")
        if not isinstance(function, dict):
            raise bad(where + ".function", "must be an object with name and arguments")
        name = _text(function.get("name"), where + ".function.name")
        arguments = function.get("arguments", function.get("input", ""))
        rendered.append(f"{name}({_text(arguments, where + '.function.arguments')})")
    return " ".join(rendered)


def _message_text(message, i: int) -> str:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise bad(where, f"must be an object with role and content, got {_kind(message)}")
    role = message.get("role")
    if role not in ROLES:
        raise bad(where + ".role", f"{role!r} is not a role: expected one of {', '.join(ROLES)}")
    if message.get("name") is not None:
        _text(message["name"], where + ".name")
    content = message.get("content")
    if role == "assistant":
        # A turn that called tools may have no content: a multi-turn tool conversation sends it back as it came.
        parts = []
        if content is not None:
            parts.append(_content_text(content, where + ".content", allow_refusal=True))
        if message.get("refusal") is not None:
            parts.append(_text(message["refusal"], where + ".refusal"))
        if message.get("tool_calls") is not None:
            parts.append(_tool_calls_text(message["tool_calls"], where + ".tool_calls"))
        if message.get("function_call") is not None:
            call = message["function_call"]
            if not isinstance(call, dict):
                raise bad(where + ".function_call", "must be an object with name and arguments")
            parts.append(
                f"{_text(call.get('name'), where + '.function_call.name')}"
                f"({_text(call.get('arguments'), where + '.function_call.arguments')})"
            )
        if message.get("audio") is not None:
            raise unsupported(
                where + ".audio", "audio turns are not supported: the models this cluster serves read text only"
            )
        text = " ".join(parts)  # an empty turn is allowed, as the API document allows it
    elif role == "function":
        _text(message.get("name"), where + ".name")
        text = "" if content is None else _text(content, where + ".content")
    else:
        if content is None:
            raise bad(where + ".content", f"is required for a {role} message")
        text = _content_text(content, where + ".content")
        if role == "tool":
            _text(message.get("tool_call_id"), where + ".tool_call_id")
    return f"<|{role}|> {text}"


def _chat_text(messages) -> str:
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list of {role, content} objects")
    return "\n".join(_message_text(m, i) for i, m in enumerate(messages)) + "\n<|assistant|>"


def _tools(body: dict) -> None:
    """Tools may be offered; the model is never forced to call one (it cannot)."""
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("tools", f"must be a list of tools, got {_kind(tools)}")
        for j, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type") not in ("function", "custom"):
                raise bad(f"tools[{j}]", "must be an object with type function and a function {name, parameters}")
            spec = tool.get(tool["type"])
            if not isinstance(spec, dict):
                raise bad(f"tools[{j}].{tool['type']}", "must be an object with a name")
            _text(spec.get("name"), f"tools[{j}].{tool['type']}.name")
    functions = body.get("functions")
    if functions is not None:
        if not isinstance(functions, list):
            raise bad("functions", f"must be a list of functions, got {_kind(functions)}")
        for j, function in enumerate(functions):
            if not isinstance(function, dict):
                raise bad(f"functions[{j}]", "must be an object with a name")
            _text(function.get("name"), f"functions[{j}].name")
    for key in ("tool_choice", "function_call"):
        choice = body.get(key)
        if choice is None or choice in ("none", "auto"):
            continue
        if choice == "required" or isinstance(choice, dict):
            raise unsupported(
                key, "forcing a tool call is not supported by this engine: it answers in text; send auto or none"
            )
        raise bad(key, f"must be none, auto, required or a named tool, got {choice!r}")


def _chat_only(body: dict) -> None:
    """The chat parameters beyond sampling: each honoured, harmless, or refused with its reason."""
    response_format = _object(body, "response_format")
    if response_format is not None:
        kind = response_format.get("type")
        if kind in ("json_object", "json_schema", "grammar", "python"):
            raise unsupported(
                "response_format",
                f"{kind} output is not supported by this engine: it generates free text; send type text",
            )
        if kind != "text":
            raise bad(
                "response_format.type", f"{kind!r} is not a response format: expected text, json_object or json_schema"
            )
    _tools(body)
    if body.get("parallel_tool_calls") is not None:
        _bool(body, "parallel_tool_calls")
    modalities = body.get("modalities")
    if modalities is not None:
        if not isinstance(modalities, list) or not all(isinstance(m, str) for m in modalities):
            raise bad("modalities", 'must be a list such as ["text"]')
        if any(m != "text" for m in modalities):
            raise unsupported("modalities", "only text output is supported")
    for key, why in (
        ("audio", "audio output is not supported"),
        ("web_search_options", "web search is not available on this cluster"),
    ):
        if body.get(key) is not None:
            if not isinstance(body[key], dict):
                raise bad(key, f"must be an object, got {_kind(body[key])}")
            raise unsupported(key, why)
    for key in ("reasoning_effort", "verbosity"):
        if body.get(key) is not None:
            if not isinstance(body[key], str):
                raise bad(key, f"must be a string, got {_kind(body[key])}")
            raise unsupported(key, "the models this cluster serves have no such setting; leave it out")
    if _bool(body, "store"):
        raise unsupported("store", "stored completions are not supported; send false or leave it out")
    service_tier = body.get("service_tier")
    if service_tier not in (None, "auto", "default"):
        if not isinstance(service_tier, str):
            raise bad("service_tier", f"must be a string, got {_kind(service_tier)}")
        raise unsupported("service_tier", "the tier comes with your API key on this cluster; send auto or default")
    metadata = _object(body, "metadata")
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise bad("metadata", "must map strings to strings")
    for key in ("safety_identifier", "prompt_cache_key", "prompt_cache_retention"):
        if body.get(key) is not None:
            _text(body[key], key)
    prediction = body.get("prediction")
    if prediction is not None and not isinstance(prediction, dict):
        raise bad("prediction", f"must be an object, got {_kind(prediction)}")


def _prompt_ids(body: dict) -> list[int]:
    """A completion's prompt: a string or token ids, one prompt per request."""
    prompt = body.get("prompt")
    if prompt is None:
        prompt = DOCUMENT_START  # OpenAI's default: generate as from the start of a new document
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not _text(prompt, "prompt").strip():
            raise bad("prompt", "must not be empty")
        return tokens.encode(prompt)
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        if any(t < 0 or t >= tokens.MAX_TOKEN_ID for t in prompt):
            raise bad("prompt", f"token ids must be between 0 and {tokens.MAX_TOKEN_ID - 1}")
        return [int(t) for t in prompt]
    if isinstance(prompt, list) and len(prompt) > 1:
        raise unsupported("prompt", "a batch of prompts is not supported: send one prompt per request")
    raise bad("prompt", f"must be a non-empty string or a list of token ids, got {_kind(prompt)}")


def context_error(model: str, context: int, prompt: int, completion: int | None) -> ApiError:
    """vLLM's answer to a request longer than the model's context, with OpenAI's code."""
    if completion is None:
        asked = f"{prompt} tokens in the prompt"
    else:
        asked = f"{prompt + completion} tokens ({prompt} in the prompt, {completion} for the completion)"
    return ApiError(
        400,
        f"This model's maximum context length is {context} tokens. However, you requested {asked}. "
        f"Please reduce the length of the prompt or of max_tokens.",
        param="messages" if completion is None else "max_tokens",
        code="context_length_exceeded",
    )


def parse(body, kind: str, context_tokens: int | None = None) -> CompletionRequest:
    """Validate one request body; raise ApiError (400, field named) on the first thing wrong.

    `kind` is "chat" or "completion". `context_tokens` is the model's context
    length: a prompt that does not fit is refused, an explicit max_tokens that
    would overrun it is refused, and a default one is shortened to fit. Which
    models are served, and the answer when one is not, is the caller's part.
    """
    if not isinstance(body, dict):
        raise ApiError(400, "The body must be a JSON object.", param="body")
    known = CHAT if kind == "chat" else COMPLETION
    for key in body:
        if key in ROUTER_DEFAULTS and key not in known:
            if body[key] is not ROUTER_DEFAULTS[key]:
                raise unsupported(key, f"only {json.dumps(ROUTER_DEFAULTS[key])} is supported (its default)")
            continue
        if key not in known:
            raise bad(
                key,
                f"is not a parameter of {'/v1/chat/completions' if kind == 'chat' else '/v1/completions'}",
                code="unknown_parameter",
            )
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "is required: the name of a model this cluster serves (see /v1/models)")
    _text(model, "model")
    n = _int(body, "n", 1, 1, 128)
    if n != 1:
        raise unsupported("n", "only one choice per request is supported; send n=1 and make separate requests")
    if kind == "completion":
        prompt_ids = _prompt_ids(body)
        if _bool(body, "echo"):
            raise unsupported("echo", "echoing the prompt is not supported")
        if _int(body, "best_of", 1, 0, 20) > 1:
            raise unsupported("best_of", "only best_of=1 is supported")
        if body.get("suffix") is not None:
            _text(body["suffix"], "suffix")
            raise unsupported("suffix", "insertion (a suffix after the completion) is not supported")
        logprobs = _int(body, "logprobs", None, 0, MAX_COMPLETION_LOGPROBS)
        explicit = _int(body, "max_tokens", None, 1)
        default = DEFAULT_COMPLETION_MAX_TOKENS
    else:
        text = _chat_text(body.get("messages"))
        _chat_only(body)
        offered = [body[key] for key in ("tools", "functions") if body.get(key)]
        if offered:
            # The model reads the tools it is offered, as a chat template writes them into the prompt (vLLM's, with
            # tool_choice none too): they take their room in the context and their time in the prefill.
            text = "".join(f"<|tools|> {json.dumps(tools)}\n" for tools in offered) + text
        prompt_ids = tokens.encode(text)
        logprobs = None
        if _bool(body, "logprobs"):
            logprobs = _int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
        elif body.get("top_logprobs") is not None:
            _int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
            raise bad("top_logprobs", "needs logprobs set to true")
        explicit = _int(body, "max_completion_tokens", None, 1)
        explicit = explicit if explicit is not None else _int(body, "max_tokens", None, 1)
        default = DEFAULT_CHAT_MAX_TOKENS
    if not prompt_ids:
        raise bad("prompt" if kind == "completion" else "messages", "has no tokens")
    max_tokens = explicit if explicit is not None else default
    if context_tokens is not None:
        if len(prompt_ids) >= context_tokens:
            raise context_error(model, context_tokens, len(prompt_ids), None)
        if explicit is not None and len(prompt_ids) + explicit > context_tokens:
            raise context_error(model, context_tokens, len(prompt_ids), explicit)
        max_tokens = min(max_tokens, context_tokens - len(prompt_ids))
    temperature = _float(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _float(body, "top_p", 1.0, 0.0, 1.0)
    top_k = _int(body, "top_k", -1, -1)
    min_p = _float(body, "min_p", 0.0, 0.0, 1.0)
    min_tokens = _int(body, "min_tokens", 0, 0)
    if min_tokens > max_tokens:
        raise bad("min_tokens", f"must not exceed max_tokens ({max_tokens})")
    _neutral(body, "frequency_penalty", -2.0, 2.0, 0.0, "a frequency penalty")
    _neutral(body, "presence_penalty", -2.0, 2.0, 0.0, "a presence penalty")
    _neutral(body, "repetition_penalty", 0.0, 2.0, 1.0, "a repetition penalty")
    logit_bias = _object(body, "logit_bias")
    if logit_bias:
        raise unsupported("logit_bias", "biasing token logits is not supported by this engine; send {} or leave it out")
    seed = _int(body, "seed", None, -(2**63), 2**63 - 1)
    if seed is None:
        # Sampling without a seed still needs one fixed for the request's life,
        # so that a migrated request continues the same text.
        seed = secrets.randbits(62) if temperature > 0 else 0
    stream = _bool(body, "stream")
    ignore_eos = _bool(body, "ignore_eos")
    stream_options = _object(body, "stream_options") or {}
    for key, value in stream_options.items():
        if key not in ("include_usage", "include_obfuscation", "continuous_usage_stats"):
            raise bad(f"stream_options.{key}", "is not a stream option: expected include_usage")
        if not isinstance(value, bool):
            raise bad(f"stream_options.{key}", f"must be true or false, got {_kind(value)}")
    if body.get("user") is not None:
        _text(body["user"], "user")
    extension = Extension.parse(body.get("lifeline"))
    if extension.resume is not None and len(extension.resume.generated) >= max_tokens:
        raise bad(
            "lifeline.resume.generated_token_ids",
            f"nothing left to generate: {len(extension.resume.generated)} of max_tokens={max_tokens} already sent",
        )
    if _bool(body, "return_token_ids"):
        extension.return_token_ids = True
    return CompletionRequest(
        kind=kind,
        model=model,
        prompt_ids=prompt_ids,
        params=SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            stop=_stop(body),
            logprobs=logprobs,
            ignore_eos=ignore_eos,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            min_tokens=min_tokens,
        ),
        stream=stream,
        include_usage=bool(stream_options.get("include_usage")),
        request_id=extension.request_id or ("cmpl-" if kind == "completion" else "chatcmpl-") + secrets.token_hex(12),
        extension=extension,
        body=body,
    )
