"""Fault injection on a staging node, from the console: only where the cluster allows it, always audited."""

from django.conf import settings

from recovery import nodeclient
from recovery.actions import audit
from recovery.models import Cluster, Node
from workers import faults as fault_kinds


def inject(node: Node, kind: str, params: dict, actor: str, reason: str) -> tuple[int, dict]:
    """Ask the node to inject `kind`; returns its HTTP status and answer (an OpenAI-style error on refusal)."""
    if not Cluster.default().fault_injection_enabled:
        return 403, {
            "error": {"message": "Fault injection is off for this cluster (a staging setting an admin turns on)."}
        }
    if kind not in fault_kinds.KINDS:
        return 400, {
            "error": {
                "message": f"kind: {kind!r} is not a fault: expected one of {', '.join(fault_kinds.KINDS)}",
                "field": "kind",
            }
        }
    audit.record(actor, "inject_fault", f"node:{node.name}", reason, kind=kind, params=params)
    try:
        return nodeclient.call(
            node.address,
            "POST",
            "/agent/faults",
            {"kind": kind, **params},
            timeout=3,
            token=settings.LIFELINE_FAULT_TOKEN or "",
        )
    except nodeclient.NodeUnreachable as exc:
        return 502, {"error": {"message": f"{node.name} did not answer: {exc}"}}
