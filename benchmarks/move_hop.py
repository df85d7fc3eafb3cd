"""What a move off a crashed node costs beyond the KV restore, by how many requests move at once.

`sim_validation` found the simulator's interrupted-request stall short of the real one on the restore paths, and the
gateway's own timing (recovery.gateway.relay's stall_breakdown_ms) put the gap in the move itself: the gateway
noticing the break, and the target answering later than its restore alone. Fitting those from the validation's
own runs would tune the simulator to its own test, so this measures them apart, on a scenario of its own:

  for k in MOVES: 2 emulated nodes (Qwen3-32B on one H100-SXM each, as sim_validation's, time scale 1), a real
  gateway process, Redis; 2·k greedy streams (ignore_eos, OUTPUT_TOKENS each, prompts of PROMPT_WORDS words), the
  gateway spreading them over the two; once every stream has decoded for DECODE_BEFORE_KILL_S, the node with more
  of them is SIGKILLed, and its streams move to the other, restored from its host memory (it holds every
  checkpoint: the only other node). ROUNDS rounds per k.

Per move, from its request_moved signal (when the first resumed token went out, and its stall_breakdown_ms):

  - noticed_ms: from the SIGKILL to the gateway noticing the stream broke;
  - hop_ms: from there to the target's answer, less the target's own restore (answered_ms − restore_ms): the
    recovery plan, the resume request, and both processes' handling of it and of the other moves;
  - order: the move's place among the round's moves, by when the target answered (0 first).

Fitted by least squares over every move: hop_ms ≈ a + b·n, n the moves made at once, and ≈ a + b·order, and the mean
noticed_ms. The first token after the answer is the target's own (its step, its queue: at 12 moves its KV is full
and some wait for others to finish); it is reported, not fitted. recovery.sim's MOVE_HOP_S and
faults.DetectionDefaults.stream_break_s are these figures; the simulator is validated with them against
sim_validation's runs, which this does not use.


    REDIS_URL=redis://127.0.0.1:6379/8 .venv/bin/python -m benchmarks.move_hop [--moves 1 2 4 8 12] [--rounds 3]
"""

import argparse
import asyncio
import random
import statistics
import time

import aiohttp

from benchmarks.common import save
from benchmarks.harness import Harness
from benchmarks.policy_comparison import busiest
from benchmarks.sim_validation import GPU, MODEL, TP, WORDS, break_noticed_at, stream

MOVES = (1, 2, 4, 8, 12)
ROUNDS = 3
PROMPT_WORDS = (600, 1500)
OUTPUT_TOKENS = 300
DECODE_BEFORE_KILL_S = 1.0  # once every stream decodes: a few dozen tokens each, all checkpointed, before the kill
SEED = 5


def all_decoding(harness: Harness, streams: int) -> bool:
    """Every stream is on a node and past its prefill: the nodes have nothing waiting or left to prefill."""
    loads = [node.status()["load"] for node in harness.nodes.values()]
    running = sum(load["running"] for load in loads)
    return running == streams and not any(load["waiting"] or load["uncomputed_prefill_tokens"] for load in loads)


async def one_round(k: int, rng: random.Random) -> dict:
    harness = Harness(2, model=MODEL, gpu=GPU, tp=TP, racks=2, policy="lifeline", assist=False)
    try:
        await asyncio.to_thread(harness.start_nodes)
        await harness.start_gateway()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            prompts = [" ".join(rng.choices(WORDS, k=rng.randint(*PROMPT_WORDS))) for _ in range(2 * k)]
            tasks = [asyncio.create_task(stream(session, harness.gateway_url, p, OUTPUT_TOKENS)) for p in prompts]
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not await asyncio.to_thread(all_decoding, harness, 2 * k):
                await asyncio.sleep(0.05)
            await asyncio.sleep(DECODE_BEFORE_KILL_S)
            name, in_flight = await asyncio.to_thread(busiest, harness)
            killed_at = time.time()
            await harness.kill(name, restart_after_s=3600)  # not back within the round
            sent = await asyncio.gather(*tasks)
            await asyncio.sleep(0.5)  # the gateway's signals go out after the streams end
            moves = [
                m
                for m in await asyncio.to_thread(harness.signals, "request_moved")
                if m.get("from") == name and m.get("kind") == "failure"
            ]
    finally:
        await harness.close()
    rows = []
    for m in moves:
        b = m["stall_breakdown_ms"]
        noticed_at = break_noticed_at(m)
        answered_at = noticed_at + b["answered_ms"] / 1000
        rows.append(
            {
                "method": m.get("method"),
                "noticed_ms": round((noticed_at - killed_at) * 1000, 1),
                "restore_ms": b.get("restore_ms"),
                "hop_ms": round(b["answered_ms"] - (b.get("restore_ms") or 0.0), 1),
                "first_token_ms": b["first_token_ms"],
                "answered_at": answered_at,
            }
        )
    rows.sort(key=lambda r: r["answered_at"])
    for order, row in enumerate(rows):
        row["order"], row["at_once"] = order, len(rows)
        del row["answered_at"]
    errors = [s.error for s in sent if s.error]
    return {"k_requested": k, "killed": name, "in_flight_on_it": in_flight, "moves": rows, "errors": errors}


def fit(rows: list[dict]) -> dict:
    """hop_ms by least squares against the moves made at once (every move of a round waits on the round's others
    alike) and against the move's order among them (the later answered wait on the earlier), whichever leaves the
    smaller residual; noticed_ms's mean."""
    out: dict = {"moves": len(rows)}
    if len({r["at_once"] for r in rows}) < 2:
        return out
    ys = [r["hop_ms"] for r in rows]
    for name in ("at_once", "order"):
        xs = [r[name] for r in rows]
        slope, intercept = statistics.linear_regression(xs, ys)
        residuals = [y - (intercept + slope * x) for x, y in zip(xs, ys)]
        out[f"hop_ms_by_{name}"] = {
            "intercept_ms": round(intercept, 2),
            "ms_per_move": round(slope, 2),
            "residual_sd_ms": round(statistics.pstdev(residuals), 2),
        }
    out["noticed_ms_mean"] = round(statistics.mean(r["noticed_ms"] for r in rows), 2)
    out["noticed_ms_sd"] = round(statistics.pstdev(r["noticed_ms"] for r in rows), 2)
    return out


async def main(moves: list[int], rounds: int) -> dict:
    rng = random.Random(SEED)
    runs = []
    for k in moves:
        for _ in range(rounds):
            run = await one_round(k, rng)
            runs.append(run)
            hops = [r["hop_ms"] for r in run["moves"]]
            print(
                f"k={k}: {len(run['moves'])} moves off {run['killed']}, noticed "
                f"{statistics.mean(r['noticed_ms'] for r in run['moves']) if hops else float('nan'):.1f} ms, "
                f"hop mean {statistics.mean(hops) if hops else float('nan'):.1f} ms max {max(hops, default=0):.1f}",
                flush=True,
            )
    every = [r for run in runs for r in run["moves"] if r["method"] == "checkpoint-local"]
    by_count: dict[int, list[dict]] = {}
    for run in runs:
        by_count.setdefault(len(run["moves"]), []).extend(run["moves"])
    summary = {
        str(n): {
            "rounds_moves": len(rows),
            "noticed_ms_mean": round(statistics.mean(r["noticed_ms"] for r in rows), 1),
            "hop_ms_mean": round(statistics.mean(r["hop_ms"] for r in rows), 1),
            "hop_ms_max": max(r["hop_ms"] for r in rows),
            "restore_ms_mean": round(statistics.mean(r["restore_ms"] or 0 for r in rows), 1),
        }
        for n, rows in sorted(by_count.items())
        if rows
    }
    return {
        "setup": {
            "nodes": 2,
            "model": MODEL,
            "gpu": GPU,
            "time_scale": 1.0,
            "output_tokens": OUTPUT_TOKENS,
            "prompt_words": PROMPT_WORDS,
            "decode_before_kill_s": DECODE_BEFORE_KILL_S,
            "rounds_per_k": rounds,
        },
        "fit_restored_moves": fit(every),
        "by_moves_at_once": summary,
        "errors": [e for run in runs for e in run["errors"]],
        "runs": runs,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--moves", type=int, nargs="+", default=list(MOVES))
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args()
    save("move_hop", asyncio.run(main(args.moves, args.rounds)))
