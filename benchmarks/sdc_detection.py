"""Silent data corruption injected → the node out of routing, at every gateway: median and p99, given the interval.

The whole system with its Celery worker and beat and 8 emulated nodes. In each round, silent
corruption (logits drifting, tokens still right: the hardest kind to see) is injected on four nodes
at random moments; the clock stops when the gateway's routing table gives the node weight 0. The
canary interval is set on the settings page (here by its API); after a failure the node is checked
again sooner (canary_retry_s), so three failures in a row take about an interval plus two retries.
Between rounds the fault is cleared, the proposed drains rejected, and each node returns through its
breaker's half-open trial canary.

    python -m benchmarks.sdc_detection [--interval 10] [--rounds 5]
"""

import argparse
import random
import statistics
import threading
import time

from benchmarks.common import percentile, save
from benchmarks.opsstack import OpsStack, http_json, wait_for


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--interval", type=int, default=10)
    parser.add_argument("--retry", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-round", type=int, default=4)
    args = parser.parse_args()
    rng = random.Random(11)
    stack = OpsStack(8, time_scale=1.0).start()
    oncall = stack.token_for("oncall")
    times, suspicious_times = [], []
    try:
        settings = {
            "canary_interval_s": args.interval,
            "canary_retry_s": args.retry,
            "breaker_open_s": 3,
            "auto_cordon_max_share": 1.0,
            "reason": "benchmark",
        }
        assert stack.api("PATCH", "/api/settings", settings)[0] == 200
        names = [n["name"] for n in stack.info["nodes"]]
        wait_for(
            lambda: all(stack.api("GET", f"/api/nodes/{n}/health")[1]["canaries"] for n in names),
            3 * args.interval,
            1,
            "first canaries",
        )
        fault_headers = {"Authorization": f"Bearer {stack.info['fault_token']}"}
        for round_ in range(args.rounds):
            targets = rng.sample(names, args.per_round)
            results: dict[str, tuple[float, float]] = {}

            def trial(name: str, results: dict[str, tuple[float, float]]) -> None:
                time.sleep(rng.uniform(0, args.interval))  # a random moment in the canary cycle
                address = stack.node(name)["address"]
                http_json(
                    address + "/agent/faults",
                    data={"kind": "sdc", "rate": 0.0, "logprob_drift": -1.5},
                    headers=fault_headers,
                )
                injected = time.monotonic()
                suspicious = None
                while time.monotonic() - injected < 10 * args.interval:
                    weight = stack.gateway_health()["weights"].get(name)
                    if weight == 0.5 and suspicious is None:
                        suspicious = time.monotonic() - injected
                    if weight == 0.0:
                        results[name] = (time.monotonic() - injected, suspicious or 0.0)
                        return
                    time.sleep(0.02)

            threads = [threading.Thread(target=trial, args=(name, results)) for name in targets]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for _, (out_s, suspicious_s) in results.items():
                times.append(out_s)
                suspicious_times.append(suspicious_s)
            print(
                f"round {round_ + 1}: " + ", ".join(f"{n} {s:.2f} s" for n, (s, _) in sorted(results.items())),
                flush=True,
            )
            # Put them back: end the corruption, reject the drains, let the half-open trial return each node.
            for name in targets:
                http_json(stack.node(name)["address"] + "/agent/faults", method="DELETE", headers=fault_headers)
            for drain in stack.api("GET", "/api/drains")[1]["drains"]:
                if drain["waiting"]:
                    stack.api(
                        "POST", f"/api/drains/{drain['id']}/reject", {"reason": "benchmark round over"}, token=oncall
                    )
            wait_for(
                lambda: all(w == 1.0 for w in stack.gateway_health()["weights"].values()), 60, 0.5, "every node back"
            )
    finally:
        stack.stop()
    figures = {
        "nodes": 8,
        "interval_s": args.interval,
        "retry_s": args.retry,
        "trials": len(times),
        "out_of_routing_s_median": round(statistics.median(times), 2),
        "out_of_routing_s_p99": round(percentile(times, 0.99), 2),
        "out_of_routing_s_max": round(max(times), 2),
        "out_of_routing_in_intervals_median": round(statistics.median(times) / args.interval, 2),
        "out_of_routing_in_intervals_p99": round(percentile(times, 0.99) / args.interval, 2),
        "weight_halved_s_median": round(statistics.median(suspicious_times), 2),
        "expected": "an interval's wait for the first failing canary (uniform), then two re-checks retry_s apart",
        "fault": "sdc rate 0 (tokens right), logprob drift -1.5: caught by the top-logprob range",
    }
    save("sdc_detection", figures)


if __name__ == "__main__":
    main()
