"""MoE expert-worker failures on the AW–EW datapath (document 001, TARRAGON §7.2): the longest stall an attention
worker's decoding sees when an expert worker fails, with shadows (killed, or hung), and without them (the AW waits
while a replacement EW is provisioned and loads its experts at disk bandwidth), against the restart-everything
baseline; the memory the shadows take; the datapath's steady layer time.

Real EW processes (`workers.expert_worker`, Mixtral-8x7B on H100s, time scale 1) and the AW's datapath
(`workers.refe.Refe`, in this process, six requests decoding); this benchmark plays the control plane's part
(`recovery.policy.moe`: the table's plan, its change after a loss, the replacement). Every run's outputs are
checked against the experts' pure functions: a lost or different layer is counted. The restart-everything
baseline is modelled, not run: the whole model's weights reloaded at the catalog's disk bandwidth plus the engine
start (`catalog.load_time_s`), as a job that restarts every worker on a failure would stall.

    python -m benchmarks.moe_failover [--trials 5]
"""

import argparse
import asyncio
import json
import signal
import statistics
import subprocess
import sys
import time

import aiohttp

from benchmarks.common import BASE_DIR, save
from recovery.policy import moe as moe_policy
from workers import catalog
from workers.moe import combine, expert_bytes, expert_output, gate
from workers.refe import NoLocation, Refe

MODEL = catalog.MODELS["Mixtral-8x7B"]
EWS = 4
REQUESTS = 6
STEPS = 6
KILL_AT = 70  # layers into the run: in its third decode step


class Ew:
    def __init__(self, name, experts, shadows, start="warm"):
        argv = [sys.executable, "-m", "workers.expert_worker", "--name", name, "--model", MODEL.key]
        argv += ["--experts", ",".join(map(str, experts)), "--shadows", ",".join(map(str, shadows)), "--start", start]
        self.proc = subprocess.Popen(argv, cwd=BASE_DIR, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.address = json.loads(self.proc.stdout.readline())["address"]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)


def reference(tokens: dict[str, bytes], steps: int) -> dict[str, bytes]:
    for _ in range(steps):
        for layer in range(MODEL.layers):
            tokens = {
                tid: combine(MODEL, layer, {e: expert_output(MODEL, layer, e, a) for e, _ in picks}, picks)
                for tid, a in tokens.items()
                for picks in [gate(MODEL, layer, a)]
            }
    return tokens


async def run(kind: str, slots: int) -> dict:
    """One run: `kind` is none (no failure), killed, hung, or no_shadow (killed, and its experts provisioned)."""
    table = moe_policy.plan(
        MODEL, [moe_policy.ExpertWorker(f"ew-{i}", expert_bytes(MODEL) * slots) for i in range(EWS)]
    )
    workers = {ew: Ew(ew, table.primaries_of(ew), table.shadows_of(ew)) for ew in sorted(table.ews())}
    victim = max(workers, key=lambda ew: (len(table.primaries_of(ew)), ew))
    start = {f"req-{i}": f"request {i} of the benchmark".encode() for i in range(REQUESTS)}
    gaps, provision_s = [], None
    try:
        async with aiohttp.ClientSession() as session:
            refe = Refe(MODEL, table, {ew: w.address for ew, w in workers.items()}, session)
            tokens, done, last = dict(start), 0, time.monotonic()
            for _ in range(STEPS):
                for layer in range(MODEL.layers):
                    while True:
                        try:
                            tokens = await refe.layer(layer, tokens)
                            break
                        except NoLocation:
                            # The control plane's part: a replacement EW for the lost one's experts, loaded cold.
                            began = time.monotonic()
                            lost = table.primaries_of(victim)
                            replacement = Ew("ew-new", lost, [], start="cold")
                            workers["ew-new"] = replacement
                            provision_s = time.monotonic() - began
                            new = moe_policy.with_replacement(table, lost, "ew-new")
                            refe.update(moe_policy.after_loss(new, [victim]), {"ew-new": replacement.address})
                    now = time.monotonic()
                    gaps.append(now - last)
                    last, done = now, done + 1
                    if done == KILL_AT and kind != "none":
                        workers[victim].proc.send_signal(signal.SIGSTOP if kind == "hung" else signal.SIGKILL)
    finally:
        for worker in workers.values():
            worker.stop()
    steady = statistics.median(gaps[: KILL_AT - 1])
    return {
        "kind": kind,
        "longest_stall_ms": round(max(gaps) * 1000, 1),
        "steady_layer_ms": round(steady * 1000, 2),
        "provision_s": round(provision_s, 2) if provision_s is not None else None,
        "correct": tokens == reference(start, STEPS),
        "failovers": len(refe.failovers),
    }


async def main(args) -> dict:
    size = expert_bytes(MODEL)
    shadowed = moe_policy.plan(MODEL, [moe_policy.ExpertWorker(f"ew-{i}", size * 4) for i in range(EWS)])
    results = {"model": MODEL.key, "ews": EWS, "gpu": "H100-SXM", "time_scale": 1, "runs": {}}
    for kind, slots in (("none", 4), ("killed", 4), ("hung", 4), ("no_shadow", 2)):
        runs = [await run(kind, slots) for _ in range(args.trials)]
        results["runs"][kind] = {
            "longest_stall_ms": [r["longest_stall_ms"] for r in runs],
            "median_longest_stall_ms": statistics.median(r["longest_stall_ms"] for r in runs),
            "steady_layer_ms_median": statistics.median(r["steady_layer_ms"] for r in runs),
            "provision_s": [r["provision_s"] for r in runs if r["provision_s"] is not None],
            "all_correct": all(r["correct"] for r in runs),
            "layers_lost_or_wrong": sum(0 if r["correct"] else 1 for r in runs),
        }
        print(kind, json.dumps(results["runs"][kind]))
    memory = moe_policy.memory(shadowed, MODEL)
    results["shadows"] = {
        "coverage": moe_policy.shadow_coverage(shadowed),
        "bytes_per_ew": {ew: m["shadows"] for ew, m in memory.items()},
        "share_of_ew_memory": round(
            sum(m["shadows"] for m in memory.values()) / (EWS * catalog.GPUS["H100-SXM"].memory_bytes), 3
        ),
    }
    results["restart_everything_s_modelled"] = round(catalog.load_time_s(MODEL), 1)
    baseline = results["restart_everything_s_modelled"] * 1000
    for kind in ("killed", "hung", "no_shadow"):
        stall = results["runs"][kind]["median_longest_stall_ms"]
        results["runs"][kind]["vs_restart_everything"] = round(baseline / stall, 1)
    print("shadows", json.dumps(results["shadows"]), "restart everything (modelled):", baseline / 1000, "s")
    save("moe_failover", results)
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    asyncio.run(main(parser.parse_args()))
