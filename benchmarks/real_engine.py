"""Real engines behind the gateway: the resume stall when a llama.cpp engine dies mid-stream, and how routing on
the adapters' own load spreads requests over real engines, against round-robin.

Three llama-servers (llama.cpp built from source, harness/real_engine.py) serve a Llama of random weights, each
fronted by a node agent; the gateway runs as its own process. Every figure is measured on this 2-core machine.

1. Resume: `--streams` greedy streams run through the gateway while the engine behind the busiest node is
   SIGKILLed (`--kills` times; it restarts on its port 2 s later and its node serves again). Every stream is
   compared token by token with an undisturbed run of the same request: lost and repeated tokens, and each
   moved stream's client-visible stall (the last token before the move to the first after).
2. Routing: the same Poisson arrivals of mixed prompt and output lengths, sent (a) through the gateway, which
   routes on each node's status (its engine's metrics plus the adapter's own account of what it forwarded), and
   (b) round-robin straight to the nodes, as a client without Lifeline would. TTFT, time per output token, and
   how unevenly the nodes were loaded (max over mean of running plus waiting, sampled every 100 ms).

    python -m benchmarks.real_engine [--kills 8] [--streams 6]
"""

import argparse
import asyncio
import json
import random
import secrets
import signal
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from benchmarks.common import Node, percentile, save
from benchmarks.harness import KEY, Harness
from harness.real_engine import LlamaServer, tiny_model

MODEL = "Tiny-Llama"
SERVED_AS = "lifeline/tiny-llama"
OFFERS = ["openai", "events", "resume", "telemetry"]
WORDS = "the operator drains node seven after rack b lost power and the spare takes its load".split()


class RealHarness(Harness):
    """The benchmark harness with llama-servers behind the nodes instead of emulated engines."""

    def __init__(self, engines: int):
        super().__init__(engines, model=MODEL, policy="lifeline")
        self.capabilities = OFFERS
        self.dir = Path(tempfile.mkdtemp(prefix="bench-real-"))
        self.model_path = tiny_model(self.dir / "tiny.gguf", seed=0)
        self.servers: dict[str, LlamaServer] = {}

    def start_nodes(self) -> None:
        for i in range(self.count):
            name = f"r{i}"
            self.rack_of[name] = f"rack-{i % self.racks}"
            server = LlamaServer(self.model_path, alias=SERVED_AS, log_path=self.dir / f"{name}.log").start()
            self.servers[name] = server
            self.nodes[name] = Node(name, "--engine-url", server.url, "--model", MODEL, "--rack", self.rack_of[name])
        deadline = time.monotonic() + 30
        while len(self.serving()) < self.count and time.monotonic() < deadline:
            time.sleep(0.1)
        self.publish()

    async def kill_engine(self, name: str, restart_after_s: float = 2.0) -> None:
        """SIGKILL the engine (its node agent lives on and says the engine is gone); restart it on its port."""
        server = self.servers[name]
        port = server.port
        server.kill(signal.SIGKILL)
        await asyncio.sleep(1.0)
        await asyncio.to_thread(self.publish)  # as the control plane would: out of routing
        await asyncio.sleep(restart_after_s - 1.0)
        await asyncio.to_thread(server.start, 60.0, port)
        while name not in await asyncio.to_thread(self.serving):
            await asyncio.sleep(0.1)
        await asyncio.to_thread(self.publish)

    async def close(self) -> None:
        await super().close()
        for server in self.servers.values():
            server.stop()


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def stream(session, url: str, body: dict, headers: dict) -> dict:
    """One streamed completion: its token ids, when each came, and the moves the gateway announced."""
    started = time.monotonic()
    out = {"ids": [], "times": [], "moves": [], "stalls_ms": [], "error": None, "started": started}
    moved_at = None
    try:
        async with session.post(url + "/v1/completions", json=body, headers=headers) as response:
            if response.status != 200:
                out["error"] = f"HTTP {response.status}: {(await response.text())[:200]}"
                return out
            async for raw in response.content:
                if raw.startswith(b": lifeline moved"):
                    out["moves"].append(raw.decode().strip())
                    moved_at = out["times"][-1] if out["times"] else started
                    continue
                if raw.startswith(b'data: {"error"'):
                    out["error"] = raw.decode()[6:200]
                    continue
                if not raw.startswith(b"data: {"):
                    continue
                chunk = json.loads(raw[6:])
                ids = (chunk["choices"][0].get("token_ids") or []) if chunk.get("choices") else []
                if ids:
                    now = time.monotonic()
                    if moved_at is not None:
                        out["stalls_ms"].append((now - moved_at) * 1000)
                        moved_at = None
                    out["ids"] += ids
                    out["times"] += [now] * len(ids)
    except (aiohttp.ClientError, OSError) as exc:
        out["error"] = f"{exc.__class__.__name__}: {exc}"
    return out


def body_of(text: str, max_tokens: int, **extra) -> dict:
    # return_token_ids: a node sends the ids when asked (the gateway always asks), so either path can be counted.
    return {
        "model": MODEL,
        "prompt": text,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
        **extra,
    }


async def resume_trials(harness: RealHarness, kills: int, streams: int) -> dict:
    """Streams killed mid-way on the busiest node's engine, each checked against its undisturbed run."""
    rng = random.Random(11)
    headers = {"Authorization": f"Bearer {KEY}"}
    lost = repeated = moved = errors = 0
    stalls: list[float] = []
    total = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        for trial in range(kills):
            requests = [body_of(prompt(rng, rng.randint(20, 300)), rng.choice((300, 400, 500))) for _ in range(streams)]
            reference = await asyncio.gather(*(stream(session, harness.gateway_url, b, headers) for b in requests))
            tasks = [asyncio.create_task(stream(session, harness.gateway_url, b, headers)) for b in requests]
            await asyncio.sleep(0.25)  # every stream under way
            loads = {}
            for name in harness.serving():
                load = (await asyncio.to_thread(harness.nodes[name].status))["load"]
                loads[name] = load["in_flight"]
            busiest = max(sorted(loads), key=loads.get)
            kill = asyncio.create_task(harness.kill_engine(busiest))
            results = await asyncio.gather(*tasks)
            await kill
            for ref, got in zip(reference, results):
                total += 1
                if got["error"] or ref["error"]:
                    errors += 1
                    continue
                want, have = ref["ids"], got["ids"]
                lost += max(len(want) - len(have), 0)
                repeated += max(len(have) - len(want), 0) + sum(1 for a, b in zip(have, want) if a != b)
                moved += bool(got["moves"])
                stalls += got["stalls_ms"]
            print(f"  trial {trial + 1}: killed {busiest}'s engine with {loads[busiest]} in flight", flush=True)
    return {
        "streams": total,
        "moved_streams": moved,
        "errors": errors,
        "tokens_lost": lost,
        "tokens_repeated_or_wrong": repeated,
        "stall_ms_p50": percentile(stalls, 0.5),
        "stall_ms_p99": percentile(stalls, 0.99),
        "stall_ms_max": max(stalls) if stalls else None,
        "stalls": len(stalls),
    }


async def routing_run(harness: RealHarness, direct: bool, arrivals: list[tuple[float, dict]]) -> dict:
    """The arrivals sent through the gateway, or round-robin straight to the nodes; load sampled meanwhile."""
    names = sorted(harness.nodes)
    imbalance: list[float] = []
    stop = asyncio.Event()

    async def sample():
        while not stop.is_set():
            loads = []
            for name in names:
                load = (await asyncio.to_thread(harness.nodes[name].status))["load"]
                loads.append((load["running"] or 0) + (load["waiting"] or 0))
            if sum(loads):
                imbalance.append(max(loads) / statistics.mean(loads))
            await asyncio.sleep(0.1)

    sampler = asyncio.create_task(sample())
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:

        async def one(i: int, at: float, body: dict) -> dict:
            await asyncio.sleep(at)
            if direct:
                url, headers = harness.nodes[names[i % len(names)]].address, {}
            else:
                url, headers = harness.gateway_url, {"Authorization": f"Bearer {KEY}"}
            return await stream(session, url, body, headers)

        results = await asyncio.gather(*(one(i, at, body) for i, (at, body) in enumerate(arrivals)))
    stop.set()
    await sampler
    ok = [r for r in results if not r["error"] and r["times"]]
    ttft = [(r["times"][0] - r["started"]) * 1000 for r in ok]
    tpot = [(r["times"][-1] - r["times"][0]) * 1000 / (len(r["times"]) - 1) for r in ok if len(r["times"]) > 1]
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "ttft_ms_p50": percentile(ttft, 0.5),
        "ttft_ms_p99": percentile(ttft, 0.99),
        "tpot_ms_p50": percentile(tpot, 0.5),
        "tpot_ms_p99": percentile(tpot, 0.99),
        "load_max_over_mean_mean": statistics.mean(imbalance) if imbalance else None,
        "load_max_over_mean_p90": percentile(imbalance, 0.9),
    }


def workload(rate: float, duration_s: float, seed: int = 5) -> list[tuple[float, dict]]:
    """Poisson arrivals; prompts of 20 to 600 words, outputs of 16 to 400 tokens: short and long mixed."""
    rng = random.Random(seed)
    at, arrivals = 0.0, []
    while True:
        at += rng.expovariate(rate)
        if at > duration_s:
            return arrivals
        words = rng.choice((20, 60, 200, 600))
        arrivals.append((at, body_of(prompt(rng, words), rng.choice((16, 64, 200, 400)))))


async def main(kills: int, streams: int, rate: float, duration_s: float) -> dict:
    harness = RealHarness(3)
    try:
        await asyncio.to_thread(harness.start_nodes)
        await harness.start_gateway()
        print("resume after a real engine's SIGKILL:", flush=True)
        resume = await resume_trials(harness, kills, streams)
        print(json.dumps(resume, indent=2), flush=True)
        arrivals = workload(rate, duration_s)
        print(f"routing: {len(arrivals)} Poisson arrivals at {rate}/s over {duration_s:.0f} s", flush=True)
        gateway = await routing_run(harness, False, arrivals)
        direct = await routing_run(harness, True, arrivals)
        routing = {
            "arrivals": len(arrivals),
            "rate_per_s": rate,
            "through_gateway_least_load": gateway,
            "round_robin_direct": direct,
            "ratios_gateway_over_round_robin": {
                k: round(gateway[k] / direct[k], 3)
                for k in ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "load_max_over_mean_mean")
                if gateway.get(k) and direct.get(k)
            },
        }
        print(json.dumps(routing, indent=2), flush=True)
    finally:
        await harness.close()
    return {
        "what": "3 llama.cpp servers (tiny random-weight Llama, 1 thread each) behind node agents and the gateway",
        "measured": True,
        "resume": resume,
        "routing": routing,
        "run_id": secrets.token_hex(3),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=8)
    parser.add_argument("--streams", type=int, default=6)
    parser.add_argument("--rate", type=float, default=3.0, help="arrivals per second in the routing run")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals in the routing run")
    args = parser.parse_args()
    result = asyncio.run(main(args.kills, args.streams, args.rate, args.duration))
    print(f"written to {save('real_engine', result)}")
