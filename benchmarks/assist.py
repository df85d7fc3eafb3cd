"""Speculative assist: a restarting node's draft model speeds a survivor's decoding.

A survivor serves 8 streams of Qwen3-32B on one H100 (about 30 ms a step);
a node restarting cold has its Qwen3-1.7B draft up in about 3 s while its
full model takes about 25 s more. The survivor's decode throughput is
measured with and without the draft node's k = 4 proposals per step, with
the catalog's draft agreement for the pair (0.7 for Qwen3-32B/Qwen3-1.7B)
and with 0.6 and 0.8 set on both nodes (--draft-agreement). The agreement is
an input (the share of drafted tokens equal to the target's). Every figure
here is modelled, none measured: the acceptance the survivor counts as it
verifies is the agreement drawn back (an emulated draft token is accepted
when a hash falls below it), and the emulated nodes' step times, so their
throughputs and the speed-up, are the roofline's. What the run shows is that
the assist path works end to end and gives what eq. 3 of source document 000
expects: (1 - a^(k+1)) / (1 - a) tokens per step.

    python -m benchmarks.assist [--seconds 8]
"""

import argparse
import asyncio
import json
import time
import urllib.request

from benchmarks.common import HEAD, Node, closed_loop, save
from workers.control_api import expected_tokens_per_step


def call(node: Node, method: str, path: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(
        node.address + path,
        data=json.dumps(body).encode() if body else None,
        method=method,
        headers={**HEAD, "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def throughput(node: Node, seconds: float) -> float:
    before, started = node.status()["counters"]["generation_tokens"], time.monotonic()
    body = {"model": "Qwen3-32B", "prompt": "assist " * 50, "max_tokens": 400, "temperature": 0}
    asyncio.run(closed_loop(node.address, 8, seconds, body))
    return (node.status()["counters"]["generation_tokens"] - before) / (time.monotonic() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=8)
    args = parser.parse_args()
    results = []
    for agreement in (None, 0.6, 0.8):
        override = () if agreement is None else ("--draft-agreement", str(agreement))
        label = "catalog" if agreement is None else agreement
        shape = ("--model", "Qwen3-32B", "--gpu", "H100-SXM", "--tp", "1", *override)
        survivor = Node(f"as-s-{label}", *shape)
        restarting = None
        try:
            plain = throughput(survivor, args.seconds)
            # Started only now, so that its full model (about 25 s behind its draft) is still loading throughout
            # the assisted measurement, as after a real failure.
            restarting = Node(f"as-r-{label}", *shape, "--start", "cold")
            while restarting.status()["load"]["model_state"] != "draft_ready":
                time.sleep(0.1)
            paired = call(
                survivor,
                "POST",
                "/agent/assist",
                {"draft": {"name": restarting.name, "address": restarting.address}, "k": 4},
            )
            assisted = throughput(survivor, args.seconds)
            report = call(survivor, "DELETE", "/agent/assist")
            still_loading = restarting.status()["load"]["model_state"] == "draft_ready"
        finally:
            survivor.stop()
            if restarting is not None:
                restarting.stop()
        results.append(
            {
                "draft_agreement_modelled": paired["agreement"],
                "agreement_from": "catalog" if agreement is None else "--draft-agreement",
                "k": 4,
                "acceptance_drawn": report["acceptance"],
                "tokens_per_sequence_step": report["tokens_per_sequence_step"],
                "tokens_per_step_expected_eq3": round(expected_tokens_per_step(paired["agreement"], 4), 3),
                "survivor_tokens_per_s_plain": round(plain, 1),
                "survivor_tokens_per_s_assisted": round(assisted, 1),
                "speedup": round(assisted / plain, 3),
                "draft_node_still_loading_full_model": still_loading,
            }
        )
    save(
        "assist",
        {
            "config": {
                "survivor": "Qwen3-32B on 1x H100-SXM, 8 streams",
                "draft": "Qwen3-1.7B on the restarting node's H100",
                "time_scale": 1.0,
                "seconds": args.seconds,
            },
            "runs": results,
        },
        kinds={
            "runs[].draft_agreement_modelled": "input",
            "runs[].acceptance_drawn": "modelled",
            "runs[].tokens_per_sequence_step": "modelled",
            "runs[].tokens_per_step_expected_eq3": "modelled",
            "runs[].survivor_tokens_per_s_plain": "modelled",
            "runs[].survivor_tokens_per_s_assisted": "modelled",
            "runs[].speedup": "modelled",
        },
    )


if __name__ == "__main__":
    main()
