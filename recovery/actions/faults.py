"""Fault injection on a staging node, from the console: only where the cluster allows it, always audited."""

from django.conf import settings

from recovery import nodeclient
from recovery.actions import audit
from recovery.models import Cluster, ExpertWorkerNode, Node
from workers import faults as fault_kinds
from workers.expert_worker import EW_FAULTS

OFF = "Fault injection is off for this cluster (a staging setting an admin turns on)."


def inject(node: Node, kind: str, params: dict, actor: str, reason: str) -> tuple[int, dict]:
    """Ask the node to inject `kind`; returns its HTTP status and answer (an OpenAI-style error on refusal)."""
    if not Cluster.default().fault_injection_enabled:
        return 403, {"error": {"message": OFF}}
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


def inject_ew(ew: ExpertWorkerNode, kind: str | None, actor: str, reason: str) -> tuple[int, dict]:
    """Ask an MoE expert worker to inject `kind` ("corrupt", "hang") or, with None, to clear its fault."""
    if not Cluster.default().fault_injection_enabled:
        return 403, {"error": {"message": OFF}}
    if kind is not None and kind not in EW_FAULTS:
        expected = ", ".join(EW_FAULTS)
        return 400, {
            "error": {
                "message": f"kind: {kind!r} is not a fault of an EW: expected {expected} or null",
                "field": "kind",
            }
        }
    target = f"moe:{ew.deployment.name}/{ew.name}"
    audit.record(actor, "inject_fault" if kind else "clear_fault", target, reason, kind=kind)
    try:
        return nodeclient.call(
            ew.address, "POST", "/moe/faults", {"kind": kind}, timeout=3, token=settings.LIFELINE_FAULT_TOKEN or ""
        )
    except nodeclient.NodeUnreachable as exc:
        return 502, {"error": {"message": f"{ew.name} did not answer: {exc}"}}
