"""What KV checkpoint streaming costs a serving node: decode throughput and CPU per token.

Issue figure: under 3% of decode throughput against the same run without it
(source document 001 reports under 3%). Runs alternate with and without a
holder, so slow drifts of this shared machine hit both sides alike.

    python -m benchmarks.checkpoint_overhead [--streams 64] [--seconds 20] [--rounds 2]
"""

import argparse
import asyncio
import os
import statistics
import time

from benchmarks.common import HEAD, Node, closed_loop, save


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_run(node: Node, holder: Node | None, streams: int, seconds: float) -> dict:
    lifeline = {"holders": [holder.peer()]} if holder else {}
    body = {
        "model": "Qwen3-32B",
        "prompt": "checkpoint me " * 100,
        "max_tokens": 400,
        "temperature": 0.7,
        "lifeline": lifeline,
    }
    before, cpu_before, started = node.status(), cpu_seconds(node.proc.pid), time.monotonic()
    asyncio.run(closed_loop(node.address, streams, seconds, body, HEAD))
    elapsed = time.monotonic() - started
    after = node.status()
    tokens = after["counters"]["generation_tokens"] - before["counters"]["generation_tokens"]
    streamed = after["streaming"]["pages_sent"] - before["streaming"]["pages_sent"]
    return {
        "tokens_per_s": tokens / elapsed,
        "node_cpu_us_per_token": (cpu_seconds(node.proc.pid) - cpu_before) / tokens * 1e6,
        "pages_sent": streamed,
        "bytes_accounted": after["streaming"]["bytes_accounted"] - before["streaming"]["bytes_accounted"],
        "bytes_moved": after["streaming"]["bytes_moved"] - before["streaming"]["bytes_moved"],
        "pages_refused": after["streaming"]["pages_refused"] - before["streaming"]["pages_refused"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    node = Node("ck-serving", "--model", "Qwen3-32B", "--gpu", "H100-SXM", "--tp", "2")
    holder = Node("ck-holder", "--model", "Qwen3-32B", "--gpu", "H100-SXM", "--tp", "2")
    runs = {"without": [], "with": []}
    try:
        time.sleep(1)
        for _ in range(args.rounds):
            runs["without"].append(one_run(node, None, args.streams, args.seconds))
            runs["with"].append(one_run(node, holder, args.streams, args.seconds))
        held = holder.status()["checkpoints"]
    finally:
        node.stop()
        holder.stop()
    plain = statistics.mean(r["tokens_per_s"] for r in runs["without"])
    streamed = statistics.mean(r["tokens_per_s"] for r in runs["with"])
    cpu_plain = statistics.mean(r["node_cpu_us_per_token"] for r in runs["without"])
    cpu_streamed = statistics.mean(r["node_cpu_us_per_token"] for r in runs["with"])
    save(
        "checkpoint_overhead",
        {
            "config": {
                "streams": args.streams,
                "seconds_per_run": args.seconds,
                "rounds": args.rounds,
                "deployment": "Qwen3-32B on 2x H100-SXM",
                "holder": "one other node process on this machine",
                "wire_scale": "1/4096 of the KV bytes moved",
            },
            "figures": {
                "tokens_per_s_without_checkpointing": round(plain, 1),
                "tokens_per_s_with_checkpointing": round(streamed, 1),
                "throughput_cost_pct": round(100 * (plain - streamed) / plain, 2),
                "node_cpu_us_per_token_without": round(cpu_plain, 1),
                "node_cpu_us_per_token_with": round(cpu_streamed, 1),
                "pages_streamed": sum(r["pages_sent"] for r in runs["with"]),
                "pages_refused": sum(r["pages_refused"] for r in runs["with"]),
                "gb_accounted": round(sum(r["bytes_accounted"] for r in runs["with"]) / 1e9, 2),
                "mb_moved": round(sum(r["bytes_moved"] for r in runs["with"]) / 1e6, 2),
                "holder_counters_at_end": held,
            },
            "runs": runs,
            "goal": {"throughput_cost_pct": "< 3"},
        },
    )


if __name__ == "__main__":
    main()
