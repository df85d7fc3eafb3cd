"""A fleet of 32 emulated nodes on this machine: do step times hold to the model?

Issue figure: 32 nodes with the emulated step times within 10% of the
model's. Each node reports the wall time from one step's start to the next
against the modeled time of those steps, while two streams per node keep it
busy.

    python -m benchmarks.fleet [--nodes 32] [--streams-per-node 2] [--seconds 30]
"""

import argparse
import asyncio
import statistics
import time

from benchmarks.common import Node, closed_loop, save


async def load_all(nodes: list[Node], streams: int, seconds: float) -> list[dict]:
    body = {"model": "Qwen3-32B", "prompt": "fleet " * 100, "max_tokens": 256, "temperature": 0.7}
    return await asyncio.gather(*(closed_loop(n.address, streams, seconds, body) for n in nodes))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=32)
    parser.add_argument("--streams-per-node", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=30)
    args = parser.parse_args()
    nodes = []
    try:
        for i in range(args.nodes):
            gpu = ("H100-SXM", "H200-SXM", "A100-80GB", "L40S")[i % 4]
            tp = {"L40S": 4}.get(gpu, 2)
            nodes.append(
                Node(
                    f"fleet-{i:02d}", "--model", "Qwen3-32B", "--gpu", gpu, "--tp", str(tp), "--rack", f"rack-{i // 8}"
                )
            )
        time.sleep(2)
        before = {n.name: n.status()["counters"] for n in nodes}
        started = time.monotonic()
        loads = asyncio.run(load_all(nodes, args.streams_per_node, args.seconds))
        elapsed = time.monotonic() - started
        after = {n.name: n.status() for n in nodes}
    finally:
        for node in nodes:
            node.stop()
    ratios = {}
    for name, status in after.items():
        c, b = status["counters"], before[name]
        modeled = c["step_modeled_s"] - b["step_modeled_s"]
        ratios[name] = (c["step_actual_s"] - b["step_actual_s"]) / modeled if modeled else None
    values = [r for r in ratios.values() if r is not None]
    tokens = sum(after[n]["counters"]["generation_tokens"] - before[n]["generation_tokens"] for n in after)
    save(
        "fleet",
        {
            "config": {
                "nodes": args.nodes,
                "streams_per_node": args.streams_per_node,
                "seconds": args.seconds,
                "deployments": "Qwen3-32B on 2x H100-SXM, 2x H200, 2x A100-80GB, 4x L40S (round robin)",
                "time_scale": 1.0,
            },
            "figures": {
                "nodes": args.nodes,
                "step_wall_over_modeled_mean": round(statistics.mean(values), 4),
                "step_wall_over_modeled_median": round(statistics.median(values), 4),
                "step_wall_over_modeled_max": round(max(values), 4),
                "nodes_within_10pct": sum(1 for v in values if abs(v - 1) <= 0.10),
                "tokens_per_s_fleet": round(tokens / elapsed, 1),
                "requests_completed": sum(load["requests"] for load in loads),
                "node_loop_lag_p99_ms_median": statistics.median(s["loop_lag_p99_ms"] or 0 for s in after.values()),
            },
            "per_node_step_wall_over_modeled": {k: round(v, 4) for k, v in ratios.items()},
            "goal": {"step_wall_over_modeled": "within 10% of 1.0 on every node"},
        },
    )


if __name__ == "__main__":
    main()
