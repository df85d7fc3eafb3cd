"""An idle asyncio process that measures its own wake-up lag: the machine's noise floor.

Run beside a benchmark, it shows how much of a node's event-loop lag is the
host's (CPU steal, scheduling) rather than the node's own work.
    python -m benchmarks.looplag_probe SECONDS  -> prints one JSON line
"""

import asyncio
import json
import statistics
import sys
import time


async def measure(seconds: float, interval_s: float = 0.02) -> dict:
    samples = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        before = time.monotonic()
        await asyncio.sleep(interval_s)
        samples.append(max(time.monotonic() - before - interval_s, 0.0))
    q = statistics.quantiles(samples, n=100)
    return {
        "samples": len(samples),
        "p50_ms": round(statistics.median(samples) * 1e3, 2),
        "p99_ms": round(q[98] * 1e3, 2),
        "max_ms": round(max(samples) * 1e3, 2),
    }


def steal_share(seconds_run: float, before: list[int], after: list[int]) -> float:
    """Share of CPU time the hypervisor took from this VM (the 'steal' column of /proc/stat)."""
    total = sum(after) - sum(before)
    return round((after[7] - before[7]) / total, 4) if total else 0.0


def cpu_times() -> list[int]:
    with open("/proc/stat") as handle:
        return [int(x) for x in handle.readline().split()[1:]]


if __name__ == "__main__":
    print(json.dumps(asyncio.run(measure(float(sys.argv[1])))), flush=True)
