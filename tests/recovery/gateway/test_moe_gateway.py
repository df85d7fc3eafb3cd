"""Decoupled MoE behind the gateway (document 001 §6): attention workers are nodes, so an AW killed mid-stream has
its requests resumed on another AW from the KV checkpoint its holder kept (per request, not the whole worker),
the text identical to an undisturbed run; the expert workers they share keep serving both."""

import asyncio
import json
import signal
import threading

from recovery.gateway.app import COORDINATOR_KEY
from recovery.policy import moe as moe_policy
from tests.gateway_cluster import KEY
from tests.helpers import chat_stream
from tests.workers.test_expert_workers import MIXTRAL, Ew
from workers.moe import expert_bytes

PROMPT = "Describe how the attention workers hand a request over when one of them dies " * 3


def stream(base: str, on_token=None) -> tuple[str, list[str], str]:
    return chat_stream(base, KEY, "Mixtral-8x7B", PROMPT, on_token, max_tokens=30, temperature=0)


async def test_an_attention_worker_killed_mid_stream_resumes_on_another_from_its_checkpoint(cluster, tmp_path):
    table = moe_policy.plan(MIXTRAL, [moe_policy.ExpertWorker(f"ew-{i}", expert_bytes(MIXTRAL) * 6) for i in range(3)])
    workers = {ew: Ew(ew, table.primaries_of(ew), table.shadows_of(ew)) for ew in sorted(table.ews())}
    try:
        ert = tmp_path / "ert.json"
        ert.write_text(json.dumps(table.to_json()))
        addresses = ",".join(f"{ew}={w.address}" for ew, w in workers.items())
        names = ("aw-1", "aw-2", "aw-3")
        for name in names:
            cluster.models[name] = "Mixtral-8x7B"
        cluster.start_nodes(
            *names,
            gpu="H200-SXM",
            extra=("--model", "Mixtral-8x7B", "--expert-workers", addresses, "--ert", str(ert)),
        )
        cluster.publish({"placement_policy": "lifeline"})
        base = await cluster.gateway()
        expected, _, _ = await asyncio.to_thread(stream, base)
        killed, done = [], threading.Event()

        def kill_at_12(count, node):
            if count == 12 and not done.is_set():
                done.set()
                cluster.nodes[node].kill(signal.SIGKILL)
                killed.append(node)

        text, comments, first = await asyncio.to_thread(stream, base, kill_at_12)
        assert killed == [first]
        assert text == expected  # no token lost, none repeated
        assert len(comments) == 1 and f"from {first} to" in comments[0] and "checkpoint" in comments[0], comments
        coordinator = cluster.servers[0].app[COORDINATOR_KEY]
        assert first in coordinator.failed
    finally:
        for worker in workers.values():
            if worker.proc.poll() is None:
                worker.proc.terminate()
                worker.proc.wait(10)
