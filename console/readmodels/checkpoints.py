"""The checkpoint distribution: which node's requests are checkpointed on which holder, coverage, holder balance."""

from django.utils import timezone

from recovery import hot
from recovery.choices import NodeState
from recovery.models import Cluster, Node
from recovery.policy import load, placement
from workers import catalog


def checkpoint_snapshot() -> dict:
    """Which node's requests are checkpointed on which holder, coverage, and holder balance."""
    cluster = Cluster.default()
    nodes = list(Node.objects.filter(state__in=(NodeState.SERVING, NodeState.JOIN)).order_by("name"))
    live = hot.nodes([n.name for n in nodes])
    alive = {n.name for n in nodes if n.state == NodeState.SERVING}
    matrix, held, l_hats = {}, {}, {}
    for node in nodes:
        entry = live.get(node.name) or hot.NodeEntry()
        matrix[node.name] = entry.checkpoints
        held[node.name] = entry.checkpoint_bytes_held
        per_block = catalog.model(node.model_key).kv_bytes_per_block
        l_hats[node.name] = round(
            load.holder_load(held[node.name], per_block, entry.queue_depth, cluster.alpha, cluster.beta), 2
        )
    flights = hot.gateway_flights()
    covered = sum(
        1
        for f in flights
        if any(h in alive for h in f.get("holders", [])) and f.get("context", 0) >= catalog.BLOCK_TOKENS
    )
    holders = [name for name in l_hats if held.get(name)]
    balance = placement.holder_balance([l_hats[h] for h in holders]) if holders else None
    return {
        "policy": cluster.placement_policy,
        "policy_label": cluster.get_placement_policy_display(),
        "generated_at": timezone.now().timestamp(),
        "nodes": [n.name for n in nodes],
        "matrix": matrix,
        "bytes_held": held,
        "l_hat": l_hats,
        "in_flight": len(flights),
        "covered": covered,
        "coverage": placement.coverage(len(flights), covered),
        "holder_balance": balance if balance is None or balance != float("inf") else None,
        "holders": holders,
        "flights_by_node": _count_by(flights, "node"),
    }


def _count_by(rows: list[dict], key: str) -> dict:
    counts: dict = {}
    for row in rows:
        counts[row.get(key)] = counts.get(row.get(key), 0) + 1
    return counts
