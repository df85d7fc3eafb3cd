"""The herd effect (source document 002): what dispatch-time accounting buys.

Bursts of requests arrive at the gateway at once. Without dispatch-time
accounting every decision in a burst sees the same node statuses (the nodes'
events have not come back yet), so the burst lands on the same node; with it,
each dispatch counts at once and the burst spreads. Measured: requests per
node in each burst (max over mean: 1 is a perfect spread), and the TTFT the
burst's requests got.

    python -m benchmarks.herd [--bursts 12] [--burst-size 32] [--gateways 4]

A third run sends each burst through several gateway processes in turn (4 by default), with dispatch accounting:
each gateway counts only its own dispatches, so the spread it keeps within a burst is what several gateways behind a
balancer get.
"""

import argparse
import asyncio
import statistics

import aiohttp

from benchmarks.common import save
from benchmarks.harness import Harness
from workers import tokens

WORDS = [w for w in tokens.VOCAB if w.isalpha()]


async def one_setting(accounting: bool, bursts: int, size: int, gateways: int = 1) -> dict:
    """`gateways` gateway processes share the routing table; a burst's requests go to them in turn, as a balancer
    spreads them. Dispatch accounting is per gateway: each counts only what it dispatched itself."""
    harness = Harness(8, config={"dispatch_accounting": accounting})
    spreads, ttfts = [], []
    try:
        await asyncio.to_thread(harness.start_nodes)
        await harness.start_gateway()
        urls = [harness.gateway_url, *await harness.start_more_gateways(gateways - 1)]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            for b in range(bursts):
                prompts = [" ".join(WORDS[(b * size + i + j) % len(WORDS)] for j in range(300)) for i in range(size)]
                results = await asyncio.gather(
                    *(harness.request(session, p, 32, urls[i % len(urls)]) for i, p in enumerate(prompts))
                )
                ttfts += [r.ttft_s for r in results if r.ttft_s is not None]
                per_node = {}
                for r in results:
                    per_node[r.node] = per_node.get(r.node, 0) + 1
                spreads.append(max(per_node.values()) / (size / len(harness.nodes)))
                await asyncio.sleep(1.0)  # the cluster drains between bursts
    finally:
        await harness.close()
    return {
        "dispatch_accounting": accounting,
        "gateways": gateways,
        "burst_max_over_mean_requests_per_node": round(statistics.mean(spreads), 2),
        "worst_burst_max_over_mean": round(max(spreads), 2),
        "ttft_ms_mean": round(1000 * statistics.mean(ttfts), 1),
        "ttft_ms_p99": round(1000 * sorted(ttfts)[int(0.99 * (len(ttfts) - 1))], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bursts", type=int, default=12)
    parser.add_argument("--burst-size", type=int, default=32)
    parser.add_argument("--gateways", type=int, default=4, help="gateway processes in the several-gateways run")
    args = parser.parse_args()
    with_it = asyncio.run(one_setting(True, args.bursts, args.burst_size))
    without = asyncio.run(one_setting(False, args.bursts, args.burst_size))
    several = asyncio.run(one_setting(True, args.bursts, args.burst_size, args.gateways))
    save(
        "herd",
        {
            "config": {
                "nodes": 8,
                "deployment": "Qwen3-32B on 1x H100-SXM each",
                "bursts": args.bursts,
                "burst_size": args.burst_size,
                "prompt_tokens": 300,
                "max_tokens": 32,
            },
            "with_dispatch_accounting": with_it,
            "without_dispatch_accounting": without,
            "ttft_mean_ratio_without_over_with": round(without["ttft_ms_mean"] / with_it["ttft_ms_mean"], 2),
            # Issue 16, item 5: dispatch accounting is per gateway; with several, each sees only its share of a
            # burst until the nodes' status events come back.
            f"with_dispatch_accounting_{args.gateways}_gateways": several,
            "spread_ratio_several_over_one": round(
                several["burst_max_over_mean_requests_per_node"] / with_it["burst_max_over_mean_requests_per_node"], 2
            ),
        },
    )


if __name__ == "__main__":
    main()
