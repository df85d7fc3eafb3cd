"""From drain approval to zero requests on the node, with 50 in-flight requests migrated live (issue: tokens lost 0).

The whole system with one serving node and one hot spare (the spare takes no traffic, so all 50
streams land on the serving node). 50 greedy streams run through the gateway, each checked token by
token against the pure token function; an operator requests a drain (immediate: live migration), an
on-call engineer approves it, and the clock runs from the approval until the node reports nothing
running or waiting. The spare is promoted at the cordon and
takes the streams; the benchmark reports that time, the drain's own steps, each moved stream's
client-visible stall, and tokens lost or repeated.

    python -m benchmarks.drain_migration [--streams 50] [--time-scale 1]
"""

import argparse
import asyncio
import random
import statistics
import time

import aiohttp

from benchmarks.common import percentile, save
from benchmarks.harness import WORDS, checked_stream
from benchmarks.opsstack import OpsStack, http_json, wait_for


async def run(args) -> dict:
    stack = OpsStack(1, spares=1, time_scale=args.time_scale).start()
    oncall = stack.token_for("oncall")
    operator = stack.token_for("operator")
    rng = random.Random(5)
    try:
        node = stack.info["nodes"][0]["name"]
        key = stack.info["gateway_keys"]["premium"]
        prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(100, 600))) for _ in range(args.streams)]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            tasks = [
                asyncio.create_task(
                    checked_stream(session, stack.gateway, key, "Qwen3-32B", p, args.max_tokens, ignore_eos=True)
                )
                for p in prompts
            ]
            address = stack.node(node)["address"]
            await asyncio.to_thread(
                wait_for,
                lambda: http_json(address + "/agent/status")[1]["load"]["running"] == args.streams,
                60,
                0.1,
                f"{args.streams} running on {node}",
            )
            await asyncio.sleep(args.warm_s)  # every stream well into its decode
            status, drain = await asyncio.to_thread(
                stack.api,
                "POST",
                "/api/drains",
                {
                    "node": node,
                    "reason": "benchmark: planned maintenance",
                    "mode": "immediate",
                    "remediation": "restart",
                },
                operator,
            )
            assert status == 201, drain
            approved = time.monotonic()
            status, answer = await asyncio.to_thread(
                stack.api, "POST", f"/api/drains/{drain['id']}/approve", {"reason": "benchmark"}, oncall
            )
            assert status == 200 and answer["state"] == "approved", answer

            def empty() -> bool:
                load = http_json(address + "/agent/status")[1]["load"]
                return load["running"] + load["waiting"] == 0

            await asyncio.to_thread(wait_for, empty, 120, 0.02, "no request left on the node")
            zero_s = time.monotonic() - approved
            results = await asyncio.gather(*tasks)
        status, detail = await asyncio.to_thread(stack.api, "GET", f"/api/drains/{drain['id']}")
    finally:
        await asyncio.to_thread(stack.stop)
    steps = {s["new"]: s["at"] for s in detail["steps"]}
    stalls = [s for r in results for s in r.stalls_ms]
    return {
        "streams": args.streams,
        "time_scale": args.time_scale,
        "max_tokens": args.max_tokens,
        "approval_to_zero_requests_s": round(zero_s, 3),
        "drain_steps_s_after_approval": {
            k: round(v - steps["approved"], 3) for k, v in steps.items() if k not in ("proposed",)
        },
        "moved_streams": sum(1 for r in results if r.moves),
        "tokens_lost": sum(r.lost for r in results),
        "tokens_repeated_or_wrong": sum(r.repeated_or_wrong for r in results),
        "errors": [r.error for r in results if r.error][:5],
        "stall_ms_p50": round(statistics.median(stalls), 1) if stalls else None,
        "stall_ms_p99": round(percentile(stalls, 0.99), 1) if stalls else None,
        "drain_state": detail["state"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=1500)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--warm-s", type=float, default=3.0)
    args = parser.parse_args()
    save("drain_migration", asyncio.run(run(args)))


if __name__ == "__main__":
    main()
