"""The audit log: who did what to what, and why. Written by the action that made the change, whatever door it came
through."""

from recovery.models import AuditEntry


def record(actor: str, action: str, target: str, reason: str = "", **details) -> AuditEntry:
    return AuditEntry.objects.create(actor=actor, action=action, target=target, reason=reason, details=details)
