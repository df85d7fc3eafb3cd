"""A canary round over 64 emulated nodes with the Celery worker on this machine (issue: within one interval).

Starts the whole system (`manage.py demo --nodes 64`: web, Celery worker and beat, gateway, 64 node
processes), waits until every node has had its first canary (the golden runs are recorded on the way),
then takes the following rounds: every node comes due at the same moment, so a round's length is the
span from its first check to its last, with the worker's two processes doing all 64 calls. Also GPU
time per canary as document 003 accounts it (one prefill pass plus a decode step per further token,
from the roofline model) and its share of the GPU at the interval.

    python -m benchmarks.canary_round [--nodes 64] [--interval 30] [--rounds 3]
"""

import argparse
import statistics
import time

from benchmarks.common import percentile, save
from benchmarks.opsstack import OpsStack, wait_for


def canaries(stack: OpsStack, names: list[str]) -> dict[str, list[dict]]:
    return {name: stack.api("GET", f"/api/nodes/{name}/health")[1]["canaries"] for name in names}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--interval", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    started = time.monotonic()
    stack = OpsStack(args.nodes, time_scale=1.0, worker_concurrency=2).start()
    try:
        took_to_start = time.monotonic() - started
        names = [n["name"] for n in stack.info["nodes"]]
        assert (
            stack.api("PATCH", "/api/settings", {"canary_interval_s": args.interval, "reason": "benchmark"})[0] == 200
        )
        wait_for(lambda: all(canaries(stack, names).values()), args.interval * 3, 2.0, "a first canary on every node")
        first_round_done = time.time()
        wait_for(
            lambda: time.time() > first_round_done + args.rounds * args.interval + 5,
            args.rounds * args.interval + 10,
            1.0,
            "rounds",
        )
        results = canaries(stack, names)
    finally:
        stack.stop()
    checks = sorted((c for rows in results.values() for c in rows), key=lambda c: c["at"])
    rounds, current = [], []
    for check in checks:  # a round: checks within half an interval of its first
        if current and check["at"] - current[0]["at"] > args.interval / 2:
            rounds.append(current)
            current = []
        current.append(check)
    rounds.append(current)
    full = [r for r in rounds if len(r) >= args.nodes][
        -args.rounds :
    ]  # whole rounds; the first one also records the golden runs
    spans = [r[-1]["at"] - r[0]["at"] for r in full]
    gpu_ms = [c["gpu_ms"] for c in checks if c["gpu_ms"]]
    latency = [c["latency_ms"] for c in checks if c["latency_ms"]]
    figures = {
        "nodes": args.nodes,
        "interval_s": args.interval,
        "rounds_measured": len(full),
        "checks_per_round": [len(r) for r in full],
        "round_span_s": [round(s, 2) for s in spans],
        "round_span_max_s": round(max(spans), 2) if spans else None,
        "within_one_interval": bool(spans) and max(spans) < args.interval,
        "round_share_of_interval": round(max(spans) / args.interval, 3) if spans else None,
        "passed": sum(1 for c in checks if c["passed"]),
        "failed": sum(1 for c in checks if not c["passed"]),
        "canary_latency_ms_p50": round(statistics.median(latency), 1),
        "canary_latency_ms_p99": round(percentile(latency, 0.99), 1),
        "gpu_ms_per_canary_mean": round(statistics.mean(gpu_ms), 2),
        "gpu_share_at_interval": f"{statistics.mean(gpu_ms) / 1000 / args.interval:.5%}",
        "document_003": {"gpu_ms_per_canary": 2, "model": "Llama-70B at TP=8, one token", "gpu_share": "0.007%"},
        "deployment": "Qwen3-32B, TP2, H100-SXM and H200-SXM, emulated at time-scale 1",
        "stack_start_s": round(took_to_start, 1),
    }
    save("canary_round", figures)


if __name__ == "__main__":
    main()
