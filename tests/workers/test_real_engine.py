"""The real engine the tests can run: llama-server on a tiny random model (harness/real_engine.py).

What the node's adapter relies on is checked here against the real server: streamed token ids, and that a
reply cut short can be finished elsewhere by sending the prompt plus the ids generated so far.
"""

import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import gguf
import pytest

from harness.real_engine import LlamaServer, tiny_model

N = 200  # tokens per greedy reply (1-2 ms each at one thread)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    where = tmp_path_factory.mktemp("engine")
    with LlamaServer(tiny_model(where / "tiny.gguf", seed=0), parallel=4, log_path=where / "llama.log") as server:
        yield server


def _greedy(server: LlamaServer, prompt: list[int], n: int, *, cache_prompt: bool = True) -> list[int]:
    """Token ids of a temperature-0 reply, streamed from the native /completion endpoint."""
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "stream": True, "return_tokens": True}
    events = server.stream("/completion", body | {"cache_prompt": cache_prompt})
    return [token for event in events for token in event["tokens"]]


def _prompt(server: LlamaServer, text: str) -> list[int]:
    return server.request("/tokenize", {"content": text, "add_special": True})["tokens"]


def test_the_tiny_model_is_fixed_by_its_seed(tmp_path):
    a, again, other = (tiny_model(tmp_path / name, seed=seed) for name, seed in [("a", 0), ("b", 0), ("c", 1)])
    assert a.read_bytes() == again.read_bytes()
    assert a.read_bytes() != other.read_bytes()

    def vocabulary(path):
        reader = gguf.GGUFReader(path)
        return [reader.get_field(key).contents() for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")]

    assert vocabulary(a) == vocabulary(other)


def test_a_streamed_completion_carries_the_token_ids(server):
    body = {"prompt": _prompt(server, "The keeper of the lighthouse"), "n_predict": 20, "temperature": 0}
    events = server.stream("/completion", body | {"stream": True, "return_tokens": True, "n_probs": 2})

    *chunks, final = events
    ids = [token for chunk in chunks for token in chunk["tokens"]]
    assert len(ids) == 20 and final["stop"] and final["tokens_predicted"] == 20 and final["stop_type"] == "limit"
    assert all(len(chunk["completion_probabilities"][0]["top_logprobs"]) == 2 for chunk in chunks)
    text = "".join(chunk["content"] for chunk in chunks)
    assert server.request("/detokenize", {"tokens": ids})["content"] == text


@pytest.mark.parametrize("cache_prompt", [True, False])  # False: as on another server, nothing reused
def test_a_reply_resumed_from_its_token_ids_is_the_same_reply(server, cache_prompt):
    prompt = _prompt(server, "Can you count to ten?")
    full = _greedy(server, prompt, N, cache_prompt=cache_prompt)
    assert len(full) == N and len(set(full)) > 10  # it neither stops early nor repeats one token

    for k in (1, 7, 60, 150, N - 1):
        assert full[:k] + _greedy(server, prompt + full[:k], N - k, cache_prompt=cache_prompt) == full, k


def test_the_chat_endpoint_reads_the_template_as_tokenize_does(server):
    """The adapter may apply the template and tokenize itself, then send ids: the same prompt as /v1/chat's."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}]
    chat = server.request("/v1/chat/completions", {"messages": messages, "max_tokens": 8, "temperature": 0})
    prompt = _prompt(server, server.request("/apply-template", {"messages": messages})["prompt"])
    assert chat["usage"]["prompt_tokens"] == len(prompt)
    completion = server.request("/completion", {"prompt": prompt, "n_predict": 8, "temperature": 0})
    assert chat["choices"][0]["message"]["content"] == completion["content"]


def test_concurrent_requests_do_not_change_a_greedy_reply(tmp_path):
    with LlamaServer(tiny_model(tmp_path / "tiny.gguf", seed=1), log_path=tmp_path / "llama.log") as server:
        prompts = [_prompt(server, text) for text in ("Why is the sky blue?", "What is the capital of France?")]
        alone = [_greedy(server, prompt, N) for prompt in prompts]
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda args: _greedy(server, *args), [(p, N) for p in prompts] * 2))
            resumed = list(pool.map(lambda args: _greedy(server, *args), [(prompts[0] + alone[0][:30], N - 30)] * 2))
        metrics = urllib.request.urlopen(server.url + "/metrics").read().decode()

    assert together == alone * 2
    assert [alone[0][:30] + tail for tail in resumed] == [alone[0]] * 2
    busy = float(re.search(r"^llamacpp:n_busy_slots_per_decode (\S+)$", metrics, re.M)[1])
    assert busy > 1  # the requests did share decode batches
