"""Kill a serving node with SIGKILL mid-stream, 20 times, under steady load: is any token lost?

Issue figures: with 8 emulated nodes under steady load at time-scale 1,
tokens lost or repeated must be 0; report the client-visible stall of
interrupted requests (the gap between the last token before and the first
after), p50 and p99, goal p99 under 300 ms. Every client checks every token
against the pure token function. Killed nodes restart warm after 2 s, so the
fleet keeps its size across the 20 kills.

    python -m benchmarks.recovery_kill [--kills 20] [--streams 24]
"""

import argparse
import asyncio
import json
import random
import statistics
import time

import aiohttp

from benchmarks.common import percentile, save
from benchmarks.harness import WORDS, Harness


async def run(kills: int, streams: int, policy: str) -> dict:
    harness = Harness(8, policy=policy, restart="warm")
    results = []
    rng = random.Random(7)
    try:
        await asyncio.to_thread(harness.start_nodes)
        await harness.start_gateway()
        stop = asyncio.Event()

        async def client(session):
            while not stop.is_set():
                prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(100, 600)))
                results.append(await harness.request(session, prompt, rng.choice((200, 300, 400))))

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            clients = [asyncio.create_task(client(session)) for _ in range(streams)]
            await asyncio.sleep(8)  # steady state
            killed = []
            for _ in range(kills):
                flights = [
                    json.loads(v) for v in harness.redis.hgetall(harness.keys.gateway_inflight("bench-gw")).values()
                ]
                by_node = {}
                for flight in flights:
                    by_node[flight["node"]] = by_node.get(flight["node"], 0) + 1
                alive = set(harness.serving())
                busiest = max((n for n in by_node if n in alive), key=lambda n: by_node[n], default=None)
                if busiest is None:
                    await asyncio.sleep(1)
                    continue
                killed.append({"node": busiest, "in_flight": by_node[busiest], "at": time.time()})
                await harness.kill(busiest, restart_after_s=2.0)
                await asyncio.sleep(6)
            stop.set()
            await asyncio.gather(*clients)
            metrics = harness.gateway_metrics()
    finally:
        await harness.close()
    interrupted = [r for r in results if r.moves]
    stalls = [s for r in interrupted for s in r.stalls_ms]
    ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
    methods = {}
    for line in metrics.splitlines():
        if line.startswith("lifeline_migrations_total{"):
            labels = line.split("{")[1].split("}")[0].split(",")
            key = ",".join(x for x in labels if not x.startswith(("source=", "target=")))  # by kind, method
            methods[key] = methods.get(key, 0.0) + float(line.split()[-1])
    return {
        "policy": policy,
        "kills": len(killed),
        "requests": len(results),
        "interrupted_requests": len(interrupted),
        "moves": sum(len(r.moves) for r in interrupted),
        "tokens_lost": sum(r.lost for r in results),
        "tokens_repeated_or_wrong": sum(r.repeated_or_wrong for r in results),
        "requests_with_errors": sum(1 for r in results if r.error),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "stall_ms_p50": round(statistics.median(stalls), 1) if stalls else None,
        "stall_ms_p99": round(percentile(stalls, 0.99), 1) if stalls else None,
        "stall_ms_max": round(max(stalls), 1) if stalls else None,
        "ttft_ms_mean_all": round(1000 * statistics.mean(ttfts), 1) if ttfts else None,
        "moves_by_method": methods,
        "killed": killed,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--streams", type=int, default=24)
    parser.add_argument("--policy", default="lifeline")
    args = parser.parse_args()
    figures = asyncio.run(run(args.kills, args.streams, args.policy))
    save(
        "recovery_kill",
        {
            "config": {
                "nodes": 8,
                "deployment": "Qwen3-32B on 1x H100-SXM each",
                "streams": args.streams,
                "time_scale": 1.0,
                "prompt_tokens": "100-600",
                "max_tokens": "200/300/400, greedy",
                "restart": "warm after 2 s",
            },
            "figures": figures,
            "goal": {"tokens_lost": 0, "tokens_repeated_or_wrong": 0, "stall_ms_p99": "< 300"},
        },
    )


if __name__ == "__main__":
    main()
