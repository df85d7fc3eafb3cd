"""A decoupled MoE deployment under repeated failures, end to end (issue 15; document 001, TARRAGON §7): the whole
system (`manage.py demo --moe`) with A attention workers and E expert workers of Mixtral-8x7B at time scale 1,
greedy streams through the gateway, and then:

- steady state: tokens per second and inter-token latency with nothing failing, with KV checkpoints (the default
  placement policy) and without (policy none), so the checkpointing's cost shows; against them, the same steady
  state on a second stack whose AWs bind each expert to one EW for good (`--moe-static-binding`: no table, no
  probing, no failover) and place no checkpoints, TARRAGON's baseline; and what resolving experts through the
  table costs an AW over a static binding, measured in-process per layer;
- EW failures: one expert worker in the table SIGKILLed at a time, F times; the AWs replay on shadows, the control
  plane confirms the loss, pushes the healed table, provisions the standby EW with the lost one's experts (loaded
  at disk bandwidth) and takes the killed EW, started again by its supervisor, as the next standby;
- AW failures: one attention worker with streams on it SIGKILLed at a time, F times; the gateway resumes its
  requests on other AWs from their KV checkpoints;
- the expert side restarted at once, measured: every EW SIGKILLed together, so the AWs wait until the supervisors
  have started them again and they have loaded their experts cold (the part of a restart-everything recovery this
  system can run; the whole job's restart, attention weights and KV caches too, is modelled as
  `catalog.load_time_s`, as in benchmarks/moe_failover.py).

For each failure: the longest token gap any client saw in the streams running across it (the stall), and every
stream's text against an undisturbed run of the same prompt (tokens lost, repeated or different: expected 0).
The control plane's times come from its API: the healed table, the replacement joined, the killed EW standing by.

    python -m benchmarks.moe_fleet [--aws 8] [--ews 8] [--failures 20] [--streams 8]
    python -m benchmarks.moe_fleet --failures 0     # steady state only (results/moe_fleet_steady.json)
    python -m benchmarks.moe_fleet --no-shadows     # EW failures without shadows (results/moe_fleet_no_shadows.json)
"""

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.common import BASE_DIR, machine, percentile, save
from console.stack import free_port
from harness.processes import DemoStack, chat_stream, http_json
from workers import catalog

MODEL = "Mixtral-8x7B"
DEPLOYMENT = "mixtral-moe"
PROMPTS = [f"Tell the story of expert {i} and the worker that held it, in plain words " * 2 for i in range(16)]


class Streams:
    """`count` clients, each streaming its prompts one after another through the gateway, every token timed."""

    def __init__(self, stack: DemoStack, count: int, max_tokens: int, references: dict[str, str]):
        self.base = stack.info["urls"]["gateway"].removesuffix("/v1")
        self.key, self.count, self.max_tokens = stack.info["gateway_key"], count, max_tokens
        self.references = references
        self.done: list[dict] = []  # finished streams
        self.live: dict[int, dict] = {}  # slot -> the stream running there
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, args=(slot,), daemon=True) for slot in range(count)]

    def start(self) -> "Streams":
        for thread in self.threads:
            thread.start()
        return self

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(120)

    def _client(self, slot: int) -> None:
        n = slot
        while not self.stop.is_set():
            prompt = PROMPTS[n % len(PROMPTS)]
            n += self.count
            record = {"slot": slot, "prompt": prompt, "times": [time.monotonic()], "node": None}
            with self.lock:
                self.live[slot] = record

            def tick(count, node, record=record):
                record["times"].append(time.monotonic())
                record["node"] = node

            try:
                text, comments, node = chat_stream(
                    self.base, self.key, MODEL, prompt, tick, error_ok=True, max_tokens=self.max_tokens, temperature=0
                )
                record.update(text=text, node=node, moved=sum("moved" in c for c in comments), error=None)
            except Exception as exc:  # noqa: BLE001 - a failed stream is counted, not fatal to the benchmark
                record.update(text="", error=f"{exc.__class__.__name__}: {exc}"[:300])
            record["end"] = time.monotonic()
            with self.lock:
                self.live.pop(slot, None)
                self.done.append(record)

    def on(self, node: str) -> int:
        with self.lock:
            return sum(1 for r in self.live.values() if r["node"] == node)

    def across(self, at: float, until: float) -> list[dict]:
        """Finished streams that were running at `at` and ended by `until`."""
        with self.lock:
            return [r for r in self.done if r["times"][0] <= at <= r["end"] <= until]


def judge(record: dict, references: dict[str, str]) -> dict:
    """Tokens lost, repeated or different against the undisturbed run (by characters of the text, whose tokens are
    one word each here), and the longest gap between two tokens."""
    expected, text = references[record["prompt"]], record.get("text", "")
    words, want = text.split(), expected.split()
    common = next((i for i, (a, b) in enumerate(zip(words, want, strict=False)) if a != b), min(len(words), len(want)))
    times = record["times"]
    return {
        "ok": text == expected and not record.get("error"),
        "lost": max(0, len(want) - len(words)),
        "repeated": max(0, len(words) - len(want)),
        "different": max(0, min(len(words), len(want)) - common),
        "max_gap_s": max((b - a for a, b in zip(times[1:], times[2:], strict=False)), default=0.0),
        "error": record.get("error"),
    }


def api(stack: DemoStack, path: str) -> dict:
    status, body = stack.api(path)
    assert status == 200, (path, status, body)
    return body


def wait(condition, timeout_s: float, what: str) -> float:
    began = time.monotonic()
    while not condition():
        if time.monotonic() - began > timeout_s:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(0.1)
    return time.monotonic() - began


def settled(stack: DemoStack, standby: bool = True) -> bool:
    """Every EW serving or standing by (and one standing by, unless `standby` is False)."""
    moe = api(stack, f"/api/moe/{DEPLOYMENT}")
    states = {ew["state"] for ew in moe["ews"]}
    return states <= {"serving", "standby"} and ("standby" in states or not standby)


def aws_serving(stack: DemoStack, names: list[str]) -> bool:
    nodes = {n["name"]: n for n in api(stack, "/api/cluster")["nodes"]}
    return all(nodes.get(name, {}).get("state") == "serving" for name in names)


def restarted(stack: DemoStack, names: list[str], pids: dict[str, int]) -> bool:
    """Every one of `names` runs as a new process (its supervisor started it again)."""
    now = stack.refresh()["pids"]
    return all(now.get(name) not in (None, pids[name]) for name in names)


def summarize(failures: list[dict]) -> dict:
    stalls = [f["stall_s"] for f in failures if f["stall_s"] is not None]
    judged = [j for f in failures for j in f["streams"]]
    return {
        "failures": len(failures),
        "stall_s": {
            "median": round(statistics.median(stalls), 3) if stalls else None,
            "p90": round(percentile(stalls, 0.9), 3) if stalls else None,
            "max": round(max(stalls), 3) if stalls else None,
        },
        "streams_across_failures": len(judged),
        "tokens_lost": sum(j["lost"] for j in judged),
        "tokens_repeated": sum(j["repeated"] for j in judged),
        "tokens_different": sum(j["different"] for j in judged),
        "streams_failed": sum(1 for j in judged if j["error"]),
    }


def undisturbed(stack: DemoStack, args) -> dict[str, str]:
    """Each prompt's greedy text with nothing failing: what every stream across a failure must equal."""
    base, key = stack.info["urls"]["gateway"].removesuffix("/v1"), stack.info["gateway_key"]
    references = {}
    for prompt in PROMPTS[: max(args.streams, 1) * 2]:
        references[prompt] = chat_stream(base, key, MODEL, prompt, max_tokens=args.max_tokens, temperature=0)[0]
    PROMPTS[:] = list(references)
    return references


def start_stack(args, *extra: str) -> DemoStack:
    var_dir = Path(tempfile.mkdtemp(prefix="moe-fleet-"))
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}  # its own, embedded
    env.update(LIFELINE_VAR_DIR=str(var_dir), LIFELINE_NAMESPACE=f"moe-{os.getpid()}", PYTHONUNBUFFERED="1")
    env["LIFELINE_LOG_LEVEL"] = "WARNING"
    argv = [sys.executable, "manage.py", "demo", "--nodes", "1", "--spares", "0", "--moe", "--no-traffic"]
    argv += ["--moe-aws", str(args.aws), "--moe-ews", str(args.ews), "--restart-delay", "2"]
    argv += ["--port", str(free_port()), "--gateway-port", str(free_port()), "--no-history", *extra]
    stack = DemoStack(var_dir, env, argv).start(timeout_s=300)
    aws = [f"node-aw{i + 1}" for i in range(args.aws)]
    try:
        wait(lambda: aws_serving(stack, aws) and settled(stack), 120, "every AW serving, every EW settled")
    except BaseException:
        stack.stop(signum=signal.SIGTERM)
        raise
    return stack


def static_baseline(args, references: dict) -> dict:
    """The steady state of a stack whose attention workers bind each expert to one EW for good (no table, no
    probing, no failover) and place no KV checkpoints: the baseline TARRAGON's 2.8 % and 3 % are against."""
    stack = start_stack(args, "--moe-static-binding")
    try:
        set_policy(stack, "none")
        streams = Streams(stack, args.streams, args.max_tokens, references).start()
        try:
            return steady_state(streams, references, args.steady_s)
        finally:
            streams.close()
    finally:
        stack.stop(signum=signal.SIGTERM)


def over(run: dict, baseline: dict) -> dict:
    """How much `run` costs over `baseline`, in per cent (positive: slower)."""
    return {
        "throughput_pct": round(100 * (1 - run["tokens_per_s"] / baseline["tokens_per_s"]), 1),
        "itl_p50_pct": round(100 * (run["itl_ms"]["p50"] / baseline["itl_ms"]["p50"] - 1), 1),
        "itl_p99_pct": round(100 * (run["itl_ms"]["p99"] / baseline["itl_ms"]["p99"] - 1), 1),
    }


def no_shadows(args) -> dict:
    """EW failures in a deployment whose experts have no shadow: each loss stalls the lost EW's experts until the
    standby, provisioned at disk bandwidth, serves them (TARRAGON's EW failure without shadows)."""
    stack = start_stack(args, "--moe-no-shadows")
    results: dict = {"machine": machine(), "model": MODEL, "aws": args.aws, "ews": args.ews, "time_scale": 1}
    try:
        references = undisturbed(stack, args)
        streams = Streams(stack, args.streams, args.max_tokens, references).start()
        try:
            failures = ew_failures(stack, streams, references, args, random.Random(args.seed), shadows=False)
        finally:
            streams.close()
        results["ew_failures_without_shadows"] = failures
        print("ew without shadows", json.dumps(failures["summary"]), flush=True)
        moe = api(stack, f"/api/moe/{DEPLOYMENT}")
        results["shadows"] = {"coverage": moe["shadow_coverage"], "bytes": moe["shadow_bytes"]}
        results["restart_everything_s_modelled"] = round(catalog.load_time_s(catalog.MODELS[MODEL]), 1)
        stall = failures["summary"]["stall_s"]["median"]
        if stall:
            failures["summary"]["modelled_restart_everything_over_median_stall"] = round(
                results["restart_everything_s_modelled"] / stall, 1
            )
    finally:
        stack.stop(signum=signal.SIGTERM)
    save("moe_fleet_no_shadows", results)
    return results


def run(args) -> dict:
    if args.no_shadows:
        return no_shadows(args)
    stack = start_stack(args)
    rng = random.Random(args.seed)
    results: dict = {"machine": machine(), "model": MODEL, "aws": args.aws, "ews": args.ews, "time_scale": 1}
    try:
        aws = [f"node-aw{i + 1}" for i in range(args.aws)]
        references = undisturbed(stack, args)
        streams = Streams(stack, args.streams, args.max_tokens, references).start()
        try:
            # Steady state, nothing failing: with KV checkpoints (the default placement policy) and without.
            results["steady"] = {}
            for policy in ("lifeline", "none"):
                set_policy(stack, policy)
                results["steady"][policy] = steady_state(streams, references, args.steady_s)
                print(f"steady, checkpoint placement {policy}", json.dumps(results["steady"][policy]), flush=True)
            set_policy(stack, "lifeline")
            on, off = results["steady"]["lifeline"], results["steady"]["none"]
            results["steady"]["checkpointing_cost"] = over(on, off)
            print("checkpointing cost", json.dumps(results["steady"]["checkpointing_cost"]), flush=True)
            results["steady"]["table_over_static_binding"] = indirection_cost(on["itl_ms"]["p50"])
            print("table over static binding", json.dumps(results["steady"]["table_over_static_binding"]), flush=True)
            if args.failures:
                results["ew_failures"] = ew_failures(stack, streams, references, args, rng)
                print("ew", json.dumps(results["ew_failures"]["summary"]), flush=True)
                results["aw_failures"] = aw_failures(stack, streams, references, args, rng, aws)
                print("aw", json.dumps(results["aw_failures"]["summary"]), flush=True)
                results["expert_side_restart"] = expert_side_restart(stack, streams, references, args)
                print("restart of every EW", json.dumps(results["expert_side_restart"]["summary"]), flush=True)
        finally:
            streams.close()
        moe = api(stack, f"/api/moe/{DEPLOYMENT}")
        results["shadows"] = {"coverage": moe["shadow_coverage"], "bytes": moe["shadow_bytes"]}
        results["restart_everything_s_modelled"] = round(catalog.load_time_s(catalog.MODELS[MODEL]), 1)
        for kind in ("ew_failures", "aw_failures", "expert_side_restart"):
            if kind not in results:
                continue
            stall = results[kind]["summary"]["stall_s"]["median"]
            if stall:
                results[kind]["summary"]["modelled_restart_everything_over_median_stall"] = round(
                    results["restart_everything_s_modelled"] / stall, 1
                )
    finally:
        stack.stop(signum=signal.SIGTERM)
    if args.static_baseline:
        static = results["steady"]["static_binding"] = static_baseline(args, references)
        print("steady, static binding, no checkpoints", json.dumps(static), flush=True)
        results["steady"]["table_over_static_run"] = over(results["steady"]["none"], static)
        results["steady"]["table_and_checkpoints_over_static_run"] = over(results["steady"]["lifeline"], static)
        print("over the static binding", json.dumps(results["steady"]["table_and_checkpoints_over_static_run"]))
    save("moe_fleet" if args.failures else "moe_fleet_steady", results)
    return results


def indirection_cost(itl_ms: float) -> dict:
    """What the expert routing table costs an AW over a static binding, measured in-process: resolving every token's
    experts through the table (with a set of EWs down to skip) against a fixed expert → EW map, per layer of a
    decode step of the steady state's batch, and as a share of the layer time the steady state measured."""
    import timeit

    from recovery.policy import moe as moe_policy
    from workers.moe import expert_bytes, gate

    model = catalog.MODELS[MODEL]
    ert = moe_policy.plan(model, [moe_policy.ExpertWorker(f"ew-{i}", expert_bytes(model) * 4) for i in range(8)])
    static = {e: loc.primaries[0] for e, loc in enumerate(ert.experts)}
    picks = [e for t in range(8) for e, _ in gate(model, 0, f"token {t}".encode())]  # a batch of 8, top-2 each
    down = {"ew-9"}
    rounds = 2000
    table_s = timeit.timeit(lambda: [ert.resolve(e, down) for e in picks], number=rounds) / rounds
    static_s = timeit.timeit(lambda: [static[e] for e in picks], number=rounds) / rounds
    layer_s = itl_ms / 1000 / model.layers
    return {
        "per_layer_us_table": round(table_s * 1e6, 2),
        "per_layer_us_static": round(static_s * 1e6, 2),
        "extra_share_of_layer_time_pct": round(100 * (table_s - static_s) / layer_s, 4),
    }


def set_policy(stack: DemoStack, policy: str) -> None:
    """The cluster's checkpoint placement policy, through the console's API (the demo's token is an admin's)."""
    url = stack.info["urls"]["console"].rstrip("/") + "/api/settings"
    body = {"placement_policy": policy, "reason": "benchmarks.moe_fleet: checkpointing on and off"}
    status, answer = http_json(
        url, data=body, method="PATCH", headers={"Authorization": f"Bearer {stack.info['api_token']}"}
    )
    assert status == 200, (status, answer)
    time.sleep(2.0)  # the gateways read it from Redis; streams started before the change finish under the old one


def steady_state(streams: Streams, references: dict, seconds: float) -> dict:
    """Tokens per second and inter-token latency of the streams that start and finish within `seconds`."""
    began = time.monotonic()
    time.sleep(seconds)
    with streams.lock:
        steady = [r for r in streams.done if r["times"][0] >= began]
    gaps = [b - a for r in steady for a, b in zip(r["times"][1:], r["times"][2:], strict=False)]
    tokens = sum(len(r["times"]) - 1 for r in steady)
    return {
        "seconds": seconds,
        "streams": len(steady),
        "tokens_per_s": round(tokens / seconds, 1),
        "itl_ms": {q: round(percentile(gaps, v) * 1000, 1) for q, v in (("p50", 0.5), ("p99", 0.99))} if gaps else None,
        "all_identical": all(judge(r, references)["ok"] for r in steady),
    }


def _stall(streams: Streams, references, at: float, settle_s: float) -> tuple[float | None, list[dict]]:
    """The longest token gap of the streams running across `at`, once they have finished."""
    time.sleep(settle_s)
    across = streams.across(at, time.monotonic())
    judged = [judge(r, references) for r in across]
    return (max((j["max_gap_s"] for j in judged), default=None), judged)


def ew_failures(stack, streams, references, args, rng, shadows: bool = True) -> dict:
    """With shadows the table heals at once (v+1: the shadows promoted) and the standby joins after (v+2); without,
    the table is refused, the AWs wait on the lost experts, and the standby's joining is the healing (v+1)."""
    failures = []
    for _ in range(args.failures):
        wait(lambda: settled(stack), 120, "every EW serving or standing by")
        before = api(stack, f"/api/moe/{DEPLOYMENT}")
        victim = rng.choice([ew["name"] for ew in before["ews"] if ew["in_table"] and ew["state"] == "serving"])
        stack.refresh()
        time.sleep(rng.uniform(0.5, 2.0))  # somewhere in the streams' decoding
        at = time.monotonic()
        os.kill(stack.info["pids"][victim], signal.SIGKILL)
        version = before["version"]

        def at_version(n: int, version=version) -> bool:
            return api(stack, f"/api/moe/{DEPLOYMENT}")["version"] >= version + n

        healed = wait(lambda: at_version(1), 60 if not shadows else 30, "table healed")
        joined = (wait(lambda: at_version(2), 60, "standby joined") if shadows else 0.0) + healed
        standby = wait(lambda: settled(stack), 90, f"{victim} back, standing by") + joined
        stall, judged = _stall(streams, references, at, args.settle_s)
        failures.append(
            {
                "victim": victim,
                "stall_s": stall,
                "table_healed_s": round(healed, 2),
                "replacement_joined_s": round(joined, 2),
                "killed_ew_standing_by_s": round(standby, 2),
                "streams": judged,
            }
        )
        print(f"  EW {victim}: stall {stall}, healed {healed:.1f} s, joined {joined:.1f} s", flush=True)
    summary = summarize(failures)
    summary["table_healed_s_median"] = statistics.median(f["table_healed_s"] for f in failures)
    summary["replacement_joined_s_median"] = statistics.median(f["replacement_joined_s"] for f in failures)
    return {"summary": summary, "failures": [{k: v for k, v in f.items() if k != "streams"} for f in failures]}


def aw_failures(stack, streams, references, args, rng, aws) -> dict:
    failures = []
    for _ in range(args.failures):
        wait(lambda: aws_serving(stack, aws), 120, "every AW serving")
        time.sleep(rng.uniform(0.5, 2.0))
        busy = [name for name in aws if streams.on(name)]
        victim = rng.choice(busy or aws)
        pid, on_it = stack.refresh()["pids"][victim], streams.on(victim)
        at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        back = wait(lambda: restarted(stack, [victim], {victim: pid}), 120, f"{victim} started again")  # noqa: B023
        back += wait(lambda: aws_serving(stack, aws), 120, f"{victim} serving again")  # noqa: B023
        stall, judged = _stall(streams, references, at, args.settle_s)
        failures.append({"victim": victim, "streams_on_it": on_it, "stall_s": stall, "streams": judged})
        failures[-1]["back_serving_s"] = round(back, 2)
        print(f"  AW {victim}: stall {stall}, back in {back:.1f} s", flush=True)
    return {
        "summary": summarize(failures),
        "failures": [{k: v for k, v in f.items() if k != "streams"} for f in failures],
    }


def expert_side_restart(stack, streams, references, args) -> dict:
    wait(lambda: settled(stack), 120, "every EW serving or standing by")
    pids = stack.refresh()["pids"]
    ews = [ew["name"] for ew in api(stack, f"/api/moe/{DEPLOYMENT}")["ews"]]
    time.sleep(1.0)
    at = time.monotonic()
    for ew in ews:
        os.kill(pids[ew], signal.SIGKILL)
    back = wait(lambda: restarted(stack, ews, pids), 120, "every EW started again")
    back += wait(lambda: settled(stack, standby=False), 180, "every EW back")
    stall, judged = _stall(streams, references, at, args.settle_s + 10)
    failure = {"stall_s": stall, "every_ew_back_s": round(back, 2), "streams": judged}
    return {"summary": summarize([failure]), "every_ew_back_s": failure["every_ew_back_s"]}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--aws", type=int, default=8)
    parser.add_argument("--ews", type=int, default=8)
    parser.add_argument("--failures", type=int, default=20)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--steady-s", type=float, default=30.0)
    parser.add_argument("--settle-s", type=float, default=8.0, help="wait this long after a failure for its streams")
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument(
        "--no-shadows",
        action="store_true",
        help="only EW failures, in a deployment without shadows (results/moe_fleet_no_shadows.json)",
    )
    parser.add_argument(
        "--no-static-baseline",
        dest="static_baseline",
        action="store_false",
        help="skip the steady state of a second stack whose AWs bind experts statically",
    )
    os.chdir(BASE_DIR)
    run(parser.parse_args())
