"""The canary client: one known prompt, at temperature 0, straight to one node (not through a gateway).

It streams the completion with the node's token ids and top log
probabilities (OpenAI's `logprobs`, Lifeline's `return_token_ids`), so the
verdict can compare them with the golden run. Synchronous: it runs in a
Celery task, never on a request's path.
"""

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from recovery.policy.health import CanaryAnswer

# Document 003's canary set: several tokens of prompt, so attention runs; one or two tokens out.
PROMPTS = (
    {"key": "capital", "prompt": "The capital of France is", "max_tokens": 1},
    {"key": "arithmetic", "prompt": "2 + 2 = ", "max_tokens": 1},
    {"key": "primes", "prompt": "The first five prime numbers are 2, 3, 5,", "max_tokens": 2},
)


class CanaryFailed(Exception):
    """The node gave no usable answer; `kind` is "timeout" or "no_response"."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


@dataclass(frozen=True)
class Reply:
    answer: CanaryAnswer
    texts: tuple[str, ...]


def ask(address: str, model: str, prompt: dict, timeout: float) -> Reply:
    """Run one canary prompt on the node at `address`; raises CanaryFailed without a usable answer."""
    body = {
        "model": model,
        "prompt": prompt["prompt"],
        "max_tokens": prompt["max_tokens"],
        "temperature": 0,
        "logprobs": 1,
        "stream": True,
        "lifeline": {"request_id": f"canary-{time.time_ns()}", "return_token_ids": True},
    }
    request = urllib.request.Request(
        address + "/v1/completions",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    started = time.monotonic()
    ids: list[int] = []
    tops: list = []
    texts: list[str] = []
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            for raw in response:
                if time.monotonic() - started > timeout:
                    raise CanaryFailed("timeout", f"no complete answer within {timeout:g} s")
                line = raw.decode().strip()
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise CanaryFailed("no_response", f"the node failed the request: {chunk['error'].get('message')}")
                for choice in chunk.get("choices") or []:
                    ids += choice.get("token_ids") or []
                    logprobs = choice.get("logprobs") or {}
                    texts += logprobs.get("tokens") or []
                    for top in logprobs.get("top_logprobs") or []:
                        tops.append(max(top.values()) if top else None)
    except urllib.error.HTTPError as exc:
        raise CanaryFailed("no_response", f"HTTP {exc.code}: {exc.read()[:200].decode(errors='replace')}") from None
    except TimeoutError:
        raise CanaryFailed("timeout", f"no answer within {timeout:g} s") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise CanaryFailed("no_response", f"{getattr(exc, 'reason', exc)}") from None
    latency_ms = (time.monotonic() - started) * 1000
    return Reply(CanaryAnswer(tuple(ids), tuple(tops), latency_ms), tuple(texts))
