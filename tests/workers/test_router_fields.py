"""The routers people put in front of vLLM (vllm-router, sglang-router) add SGLang's and vLLM's extras to every
request they forward, at their default values (issue 16: the OpenAI surface users' tools send). Those values are
accepted, since they change nothing; any other value is refused with the field named, never ignored in silence."""

import pytest

from workers.openai_schema import ROUTER_DEFAULTS, ApiError, parse

FORWARDED = {
    "model": "Qwen3-32B",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "max_tokens": 4,
    "logprobs": False,
    "ignore_eos": False,
    **ROUTER_DEFAULTS,  # what vllm-router 0.1.17 sent, captured from the wire
}


def test_a_body_as_vllm_router_forwards_it_is_served():
    req = parse(FORWARDED, "chat", 32768)
    assert req.params.max_tokens == 4 and req.stream


@pytest.mark.parametrize("field", sorted(ROUTER_DEFAULTS))
def test_any_other_value_is_refused_naming_the_field(field):
    with pytest.raises(ApiError) as refused:
        parse({**FORWARDED, field: not ROUTER_DEFAULTS[field]}, "chat", 32768)
    assert refused.value.status == 400 and refused.value.param == field


def test_they_are_not_completion_parameters_unless_at_their_defaults():
    body = {"model": "Qwen3-32B", "prompt": "hi", "max_tokens": 4, "no_stop_trim": False}
    assert parse(body, "completion", 32768).params.max_tokens == 4
    with pytest.raises(ApiError):
        parse({**body, "no_stop_trim": 1}, "completion", 32768)
