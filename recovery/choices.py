"""Status values with the badge colour each shows in the console."""

from django.db import models


class NodeState(models.TextChoices):
    """Node lifecycle (source document 004): JOIN -> SERVING -> DOWN -> LEFT."""

    JOIN = "join", "Joining"
    SERVING = "serving", "Serving"
    DOWN = "down", "Down"
    LEFT = "left", "Left"


NODE_STATE_BADGE = {
    NodeState.JOIN: "blue",
    NodeState.SERVING: "green",
    NodeState.DOWN: "red",
    NodeState.LEFT: "grey",
}


class Tier(models.TextChoices):
    """Priority tiers of gateway API keys; shedding starts at the bottom."""

    PREMIUM = "premium", "Premium"
    STANDARD = "standard", "Standard"
    BEST_EFFORT = "best_effort", "Best effort"


class PlacementPolicy(models.TextChoices):
    """Checkpoint placement (source document 000 and our extension); see recovery.policy.placement."""

    NONE = "none", "None (stop-and-restart)"
    FIXED = "fixed", "Fixed neighbour (DéjàVu)"
    LOAD_AWARE = "load_aware", "Load-aware (LUMEN)"
    LIFELINE = "lifeline", "Load-aware, two racks, prefill chunks (Lifeline)"


class IncidentStatus(models.TextChoices):
    """Operational convention: Active while recovering, Stable once recovered, Closed by a person."""

    ACTIVE = "active", "Active"
    STABLE = "stable", "Stable"
    CLOSED = "closed", "Closed"


INCIDENT_STATUS_BADGE = {
    IncidentStatus.ACTIVE: "red",
    IncidentStatus.STABLE: "amber",
    IncidentStatus.CLOSED: "grey",
}


class EventKind(models.TextChoices):
    SYMPTOM = "symptom", "First symptom"
    DETECTED = "detected", "Failure confirmed"
    NOT_CONFIRMED = "not_confirmed", "Symptom not confirmed"
    REMOVED = "removed", "Removed from routing"
    REQUEST_MOVED = "request_moved", "Request moved"
    HOLDER_REPLACED = "holder_replaced", "Checkpoint re-placed"
    RESTART = "restart", "Node restarted"
    DRAFT_READY = "draft_ready", "Draft model ready"
    ASSIST_STARTED = "assist_started", "Speculative assist started"
    ASSIST_ENDED = "assist_ended", "Speculative assist ended"
    FULL_MODEL_READY = "full_model_ready", "Full model ready"
    BACK_IN_ROUTING = "back_in_routing", "Back in routing"
    RECOVERED = "recovered", "Recovered"
    STATUS = "status", "Status changed"
    ACKNOWLEDGED = "acknowledged", "Acknowledged"
    COMMANDER = "commander", "Commander assigned"
    NOTE = "note", "Note"
    FAULT_INJECTED = "fault_injected", "Fault injected"
    MIGRATION = "migration", "Planned migration"


# Events a person may want to hide to read the people's side of an incident.
SYSTEM_EVENT_KINDS = {
    EventKind.REQUEST_MOVED, EventKind.HOLDER_REPLACED,
}
