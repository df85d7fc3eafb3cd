"""What the MoE page shows of a deployment (recovery.actions.moe keeps it): its expert workers as tiles, the expert
routing table as a heatmap (logical expert × EW, primary or shadow), tokens per expert, balancedness over time, and
its attention workers with the table version each took."""

from recovery.actions import moe
from recovery.choices import ExpertWorkerState, Health, NodeState
from recovery.models import MoeDeployment, Node
from workers import catalog
from workers.moe import expert_bytes

PRIMARY, SHADOW = 2, 1  # the heatmap's values


def deployments() -> list[str]:
    return list(MoeDeployment.objects.values_list("name", flat=True))


def snapshot(name: str) -> dict | None:
    deployment = MoeDeployment.objects.filter(name=name).first()
    if deployment is None:
        return None
    model = catalog.MODELS[deployment.model]
    table = moe.table(deployment)
    rows = list(deployment.ews.all())
    names = [r.name for r in rows]
    size = expert_bytes(model)
    memory_limit = {r.name: catalog.GPUS[r.gpu].memory_bytes if r.gpu in catalog.GPUS else None for r in rows}
    ews = [
        {
            "name": r.name,
            "state": r.state,
            "state_label": ExpertWorkerState(r.state).label,
            "badge": r.badge,
            "address": r.address,
            "gpu": r.gpu,
            "in_table": r.name in table.ews(),
            "primaries": table.primaries_of(r.name),
            "shadows": table.shadows_of(r.name),
            "holds": {"primaries": r.primaries, "shadows": r.shadows},
            "primary_bytes": size * len(r.primaries),
            "shadow_bytes": size * len(r.shadows),
            "gpu_bytes": memory_limit[r.name],
            "tokens": sum(int(n) for n in r.tokens.values()),
            "refused": r.refused,
            "replacing": r.replacing,
            "misses": r.misses,
            "last_seen": r.last_seen.timestamp() if r.last_seen else None,
        }
        for r in rows
    ]
    heat = [
        [PRIMARY if ew in loc.primaries else SHADOW if ew in loc.shadows else 0 for ew in names]
        for loc in table.experts
    ]
    pushed = deployment.details.get("pushed", {})
    aws = [
        {"name": n.name, "state": n.state, "health": n.health, "shown": _aw_state(n), "version": pushed.get(n.name)}
        for n in Node.objects.filter(name__in=deployment.attention_workers).order_by("name")
    ]
    series = deployment.details.get("series", [])
    tokens = deployment.details.get("tokens_per_expert", {})
    figures = moe.shadow_memory(deployment)
    return {
        "name": deployment.name,
        "model": deployment.model,
        "version": table.version,
        "experts": model.experts,
        "top_k": model.experts_per_token,
        "ews": ews,
        "ew_names": names,
        "heatmap": heat,
        "attention_workers": aws,
        "tokens_per_expert": [int(tokens.get(str(e), 0)) for e in range(model.experts)],
        "balancedness": {"at": [p["at"] for p in series], "value": [p["balancedness"] for p in series]},
        "balancedness_now": series[-1]["balancedness"] if series else None,
        "shadow_bytes": figures["shadow_bytes"],
        "primary_bytes": figures["primary_bytes"],
        "shadow_coverage": figures["coverage"],
        "updated_at": deployment.updated_at.timestamp(),
        "canary_at": deployment.details.get("canary_at"),
        "canary_goldens": len(deployment.details.get("canary_golden", {})),
        "canary_failed": deployment.details.get("canary_failed", []),
    }


def _aw_state(node: Node) -> str:
    """An attention worker's state as its operator needs it: "serving" only when it serves in routing (an unhealthy
    one was listed as serving, issue 43)."""
    if node.state != NodeState.SERVING or node.health in (Health.HEALTHY, Health.SUSPICIOUS):
        return node.state if node.health == Health.HEALTHY else f"{node.state}, {node.health}"
    return f"{node.state}, {node.health}: out of routing"
