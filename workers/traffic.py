"""A traffic generator: OpenAI requests to the gateway with Poisson arrivals.

`python -m workers.traffic --gateway http://127.0.0.1:8100 --key llk_...`
Prompts and output lengths vary like a chat workload; every 10 s it prints a
JSON summary line (sent, completed, errors by kind, tokens/s, mean TTFT).
"""

import argparse
import asyncio
import json
import logging
import os
import random
import signal
import sys
import time
from collections import Counter

import aiohttp

from workers import tokens

log = logging.getLogger("workers.traffic")

WORDS = [w for w in tokens.VOCAB if w.isalpha()]


def prompt_text(rng: random.Random) -> str:
    # Log-normal prompt lengths: mostly short chat turns, a tail of long contexts.
    length = int(min(max(rng.lognormvariate(4.3, 0.9), 8), 3000))
    return " ".join(rng.choice(WORDS) for _ in range(length))


class Stats:
    def __init__(self):
        self.sent = 0
        self.completed = 0
        self.tokens = 0
        self.ttft_sum = 0.0
        self.ttft_n = 0
        self.errors: Counter = Counter()
        self.skipped = 0
        self.in_flight = 0

    def line(self, window_s: float) -> dict:
        return {
            "event": "traffic",
            "sent": self.sent,
            "completed": self.completed,
            "in_flight": self.in_flight,
            "skipped": self.skipped,
            "errors": dict(self.errors),
            "tokens_per_s": round(self.tokens / window_s, 1),
            "mean_ttft_ms": round(1000 * self.ttft_sum / self.ttft_n, 1) if self.ttft_n else None,
        }


async def one_request(session: aiohttp.ClientSession, args, rng: random.Random, stats: Stats) -> None:
    chat = rng.random() < args.chat_share
    stream = rng.random() < args.stream_share
    body = {
        "model": args.model,
        "max_tokens": rng.choice((32, 64, 128, 128, 256)),
        "temperature": rng.choice((0.0, 0.7)),
        "stream": stream,
    }
    text = prompt_text(rng)
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = text
        path = "/v1/completions"
    started = time.monotonic()
    stats.sent += 1
    stats.in_flight += 1
    headers = {"Authorization": f"Bearer {rng.choice(args.keys)}"}  # several keys: a mix of tenants and tiers
    try:
        async with session.post(args.gateway.rstrip("/") + path, json=body, headers=headers) as response:
            if response.status != 200:
                stats.errors[str(response.status)] += 1
                await response.read()
                return
            if not stream:
                data = await response.json()
                stats.ttft_sum += time.monotonic() - started
                stats.ttft_n += 1
                stats.tokens += data.get("usage", {}).get("completion_tokens", 0)
                stats.completed += 1
                return
            first = True
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    stats.errors["stream_error"] += 1
                    return
                if chunk.get("choices"):
                    if first:
                        stats.ttft_sum += time.monotonic() - started
                        stats.ttft_n += 1
                        first = False
                    stats.tokens += 1
            stats.completed += 1
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        stats.errors[exc.__class__.__name__] += 1
    finally:
        stats.in_flight -= 1


async def run(args) -> None:
    rng = random.Random(args.seed)
    stats = Stats()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    tasks: set[asyncio.Task] = set()
    deadline = time.monotonic() + args.duration if args.duration else None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        window_started = time.monotonic()
        while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
            try:
                await asyncio.wait_for(stop.wait(), timeout=rng.expovariate(args.rate))
            except TimeoutError:
                pass
            if stop.is_set():
                break
            if stats.in_flight >= args.max_concurrency:
                stats.skipped += 1
            else:
                task = asyncio.create_task(one_request(session, args, rng, stats))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if time.monotonic() - window_started >= args.report_every:
                print(json.dumps(stats.line(time.monotonic() - window_started)), flush=True)
                stats.tokens = 0
                window_started = time.monotonic()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        print(json.dumps(stats.line(max(time.monotonic() - window_started, 1e-3))), flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m workers.traffic", description="Send OpenAI traffic to a Lifeline gateway."
    )
    parser.add_argument("--gateway", default=os.environ.get("LIFELINE_GATEWAY_URL", "http://127.0.0.1:8100"))
    parser.add_argument(
        "--key",
        default=os.environ.get("LIFELINE_GATEWAY_KEY"),
        help="gateway API key, or several separated by commas, used in turn at random (or LIFELINE_GATEWAY_KEY)",
    )
    parser.add_argument("--model", default="Qwen3-32B")
    parser.add_argument("--rate", type=float, default=2.0, help="mean requests per second")
    parser.add_argument("--max-concurrency", type=int, default=128)
    parser.add_argument("--stream-share", type=float, default=0.9)
    parser.add_argument("--chat-share", type=float, default=0.5)
    parser.add_argument("--duration", type=float, default=0, help="seconds; 0 runs until stopped")
    parser.add_argument("--report-every", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    if not args.key:
        parser.error(
            "a gateway key is required: --key or LIFELINE_GATEWAY_KEY (make one with `python manage.py create_api_key`)"
        )
    args.keys = [k.strip() for k in args.key.split(",") if k.strip()]
    if args.rate <= 0:
        parser.error("--rate must be positive")
    logging.basicConfig(level="INFO", stream=sys.stderr)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
