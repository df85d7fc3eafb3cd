"""Trusted providers (document 004), at the gateway, with real node processes: a key restricted to some providers
or regions is routed, checkpointed, given a second copy and resumed only on nodes it trusts, and told so plainly
when none is left; an unrestricted key still uses every node."""

import asyncio
import signal
import threading

from recovery.gateway.app import COORDINATOR_KEY
from tests.gateway_cluster import KEY, gw
from tests.helpers import chat_stream

RESTRICTED = "llk_test-key-restricted-to-eu-cloud"
PROMPT = "Summarise the residency rules for the tenant's chat history in the European region " * 5
WHERE = {
    "tp-eu-1": {"provider": "eu-cloud", "region": "eu-west"},
    "tp-eu-2": {"provider": "eu-cloud", "region": "eu-west"},
    "tp-us": {"provider": "us-cloud", "region": "us-east"},
}
TRUSTED = {"tp-eu-1", "tp-eu-2"}


async def residency_cluster(cluster) -> str:
    cluster.where.update(WHERE)
    cluster.keys_extra[RESTRICTED] = {
        "id": 2,
        "tenant": "eu-bank",
        "tier": "premium",
        "providers": ["eu-cloud"],
        "regions": [],
    }
    # Three racks, so a second copy would go to another rack if it could; a low tau asks for one on every request.
    racks = {"tp-eu-1": "rack-a", "tp-eu-2": "rack-b", "tp-us": "rack-c"}
    cluster.start_nodes(*WHERE, racks=racks)
    cluster.publish({"placement_policy": "lifeline", "tau_tokens": 16})
    return await cluster.gateway()


def stream(base: str, key: str, on_token=None, seed: int = 5) -> tuple[str, str, list[str]]:
    """One streamed completion; returns (text, first node, SSE comments naming the moves)."""
    text, comments, node = chat_stream(
        base, key, "Qwen3-32B", PROMPT, on_token, max_tokens=80, temperature=0.7, seed=seed
    )
    return text, node, comments


async def test_a_restricted_key_runs_and_keeps_its_checkpoints_only_on_trusted_nodes(cluster):
    base = await residency_cluster(cluster)
    coordinator = cluster.servers[0].app[COORDINATOR_KEY]
    holders_seen: set[str] = set()

    def watch_holders(count, node):
        if count % 10 == 0:  # the holders of every restricted request in flight, the second copy included
            for flight in list(coordinator.flights.values()):
                if flight.tenant == "eu-bank":
                    holders_seen.update(flight.holders)

    # Six at once: least-loaded routing spreads them over every node it may use.
    restricted = await asyncio.gather(
        *(asyncio.to_thread(stream, base, RESTRICTED, watch_holders, seed) for seed in range(6))
    )
    open_ = await asyncio.gather(*(asyncio.to_thread(stream, base, KEY, None, seed) for seed in range(6)))
    assert {node for _, node, _ in restricted} <= TRUSTED
    assert holders_seen and holders_seen <= TRUSTED, holders_seen
    assert "tp-us" in {node for _, node, _ in open_}  # an unrestricted key uses the whole fleet
    # The same request under either key is the same text: residency changes where, never what.
    assert [text for text, _, _ in restricted] == [text for text, _, _ in open_]


async def test_a_restricted_stream_resumes_on_a_trusted_node_and_is_refused_when_none_is_left(cluster):
    base = await residency_cluster(cluster)
    expected, _, _ = await asyncio.to_thread(stream, base, KEY)
    killed, done = [], threading.Event()

    def kill_at_30(count, node):
        if count == 30 and not done.is_set():
            done.set()
            cluster.nodes[node].kill(signal.SIGKILL)
            killed.append(node)

    text, first, comments = await asyncio.to_thread(stream, base, RESTRICTED, kill_at_30)
    assert killed == [first] and first in TRUSTED
    assert text == expected  # no token lost, none repeated
    (survivor,) = TRUSTED - {first}
    assert len(comments) == 1 and f"from {first} to {survivor}" in comments[0], comments

    # The last trusted node goes too: the restricted key is refused with why; the other key is still served.
    cluster.nodes[survivor].kill(signal.SIGKILL)
    cluster.publish()
    await cluster.until(base, lambda h: h["nodes"] == 1, "only tp-us left")
    headers = {"Authorization": f"Bearer {RESTRICTED}"}
    body = {"model": "Qwen3-32B", "prompt": "hello", "max_tokens": 4}
    status, answer = await gw(base + "/v1/completions", data=body, headers=headers)
    assert status == 503, answer
    message = answer["error"]["message"]
    assert "trusted provider eu-cloud" in message and "Qwen3-32B" in message
    status, answer = await gw(base + "/v1/completions", data=body, headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200 and answer["choices"][0]["text"]
