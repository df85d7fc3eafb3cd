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


class SloWindow(models.TextChoices):
    """The period an objective's error budget covers (recovery.policy.slo)."""

    ROLLING_28D = "rolling_28d", "Rolling 28 days"
    ROLLING_30D = "rolling_30d", "Rolling 30 days"
    CALENDAR_MONTH = "calendar_month", "Calendar month"


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


class IncidentSeverity(models.TextChoices):
    """How bad an incident is, from what it did to users (recovery.policy.severity has the rule)."""

    SEV1 = "sev1", "SEV1"
    SEV2 = "sev2", "SEV2"
    SEV3 = "sev3", "SEV3"


INCIDENT_SEVERITY_BADGE = {
    IncidentSeverity.SEV1: "red",
    IncidentSeverity.SEV2: "amber",
    IncidentSeverity.SEV3: "blue",
}


class EventKind(models.TextChoices):
    SYMPTOM = "symptom", "First symptom"
    DETECTED = "detected", "Failure confirmed"
    NOT_CONFIRMED = "not_confirmed", "Symptom not confirmed"
    REMOVED = "removed", "Removed from routing"
    REQUEST_MOVED = "request_moved", "Request moved"
    REQUEST_RESUMED = "request_resumed", "Stream taken over"  # by another gateway, after a lost one (Last-Event-ID)
    HOLDER_REPLACED = "holder_replaced", "Checkpoint re-placed"
    RESTART = "restart", "Node restarted"
    DRAFT_READY = "draft_ready", "Draft model ready"
    ASSIST_STARTED = "assist_started", "Speculative assist started"
    ASSIST_ENDED = "assist_ended", "Speculative assist ended"
    FULL_MODEL_READY = "full_model_ready", "Full model ready"
    BACK_IN_ROUTING = "back_in_routing", "Back in routing"
    RECOVERED = "recovered", "Latency recovered"
    CAPACITY_RESTORED = "capacity_restored", "Capacity restored"
    STATUS = "status", "Status changed"
    ACKNOWLEDGED = "acknowledged", "Acknowledged"
    COMMANDER = "commander", "Commander assigned"
    NOTE = "note", "Note"
    FAULT_INJECTED = "fault_injected", "Fault injected"
    MIGRATION = "migration", "Planned migration"

    DRAIN = "drain", "Drain"
    HEALTH = "health", "Health changed"
    SPARE_PROMOTED = "spare_promoted", "Hot spare promoted"
    DEGRADATION = "degradation", "Degradation level changed"
    PLACEMENT = "placement", "Re-placement"
    ERT = "ert", "Expert routing table changed"
    PROVISIONING = "provisioning", "Replacement provisioning"
    ALERT = "alert", "Alert"  # from Alertmanager (recovery.actions.alerts), firing or resolved
    CONDITION = "condition", "Failure began"  # a lasting failure (recovery.actions.conditions)
    CONDITION_CLEARED = "condition_cleared", "Failure cleared"


class FailureClass(models.TextChoices):
    """The failures that last, each found by its own evidence (recovery.actions.conditions) and each with its runbook
    (console.runbooks): a node's loss and silent corruption have their own paths (recovery.actions.incidents)."""

    NVLINK_DOWN = "nvlink_down", "NVLink down"
    SLOW_GPU = "slow_gpu", "Slow GPU"
    PARTITIONED = "partitioned", "Node partitioned"
    POISON_REQUEST = "poison_request", "Poison request"
    GATEWAY_LOST = "gateway_lost", "Gateway lost"
    STORE_AWAY = "store_away", "Store away"


class AlertStatus(models.TextChoices):
    FIRING = "firing", "Firing"
    RESOLVED = "resolved", "Resolved"


# Events a person may want to hide to read the people's side of an incident.
SYSTEM_EVENT_KINDS = {
    EventKind.REQUEST_MOVED,
    EventKind.HOLDER_REPLACED,
}


class Health(models.TextChoices):
    """Node health (source document 003), beside the lifecycle: how much traffic a live node should get."""

    HEALTHY = "healthy", "Healthy"
    SUSPICIOUS = "suspicious", "Suspicious"
    UNHEALTHY = "unhealthy", "Unhealthy"
    DRAINING = "draining", "Draining"


HEALTH_BADGE = {
    Health.HEALTHY: "green",
    Health.SUSPICIOUS: "amber",
    Health.UNHEALTHY: "red",
    Health.DRAINING: "blue",
}


class BreakerState(models.TextChoices):
    CLOSED = "closed", "Closed"
    OPEN = "open", "Open"
    HALF_OPEN = "half_open", "Half-open"


BREAKER_BADGE = {BreakerState.CLOSED: "green", BreakerState.OPEN: "red", BreakerState.HALF_OPEN: "amber"}


class HealthChange(models.TextChoices):
    """What a node's health transition row records."""

    HEALTH = "health", "Health"
    BREAKER = "breaker", "Circuit breaker"
    SPARE = "spare", "Hot spare"
    CORDON = "cordon", "Cordon"
    MODEL = "model", "Model load"  # loading_draft → draft_ready → loading_full → serving, from heartbeats


class DrainState(models.TextChoices):
    """Operational convention: quarantined (cordoned) → draining → drained → remediating → returned."""

    PROPOSED = "proposed", "Waiting for approval"
    APPROVED = "approved", "Approved"
    CORDONED = "cordoned", "Cordoned"
    DRAINING = "draining", "Draining"
    DRAINED = "drained", "Drained"
    REMEDIATING = "remediating", "Remediating"
    VERIFYING = "verifying", "Canary in half-open"
    RETURNED = "returned", "Back in service"
    HANDED_OFF = "handed_off", "Handed to hardware repair"
    REJECTED = "rejected", "Rejected"
    CANCELLED = "cancelled", "Cancelled"
    FAILED = "failed", "Failed"


DRAIN_BADGE = {
    DrainState.PROPOSED: "amber",
    DrainState.APPROVED: "blue",
    DrainState.CORDONED: "blue",
    DrainState.DRAINING: "blue",
    DrainState.DRAINED: "blue",
    DrainState.REMEDIATING: "blue",
    DrainState.VERIFYING: "blue",
    DrainState.RETURNED: "green",
    DrainState.HANDED_OFF: "grey",
    DrainState.REJECTED: "grey",
    DrainState.CANCELLED: "grey",
    DrainState.FAILED: "red",
}

# Drains that hold their node: at most one per node, and the pool's count for the two-person rule.
OPEN_DRAIN_STATES = (
    DrainState.PROPOSED,
    DrainState.APPROVED,
    DrainState.CORDONED,
    DrainState.DRAINING,
    DrainState.DRAINED,
    DrainState.REMEDIATING,
    DrainState.VERIFYING,
)
RUNNING_DRAIN_STATES = OPEN_DRAIN_STATES[1:]


class DrainMode(models.TextChoices):
    IMMEDIATE = "immediate", "Immediate: migrate in-flight requests live"
    ALLOW_COMPLETION = "allow_completion", "Allow completion: let in-flight requests finish"
    DEADLINE = "deadline", "Deadline: let them finish, migrate what is left at the deadline"


class Remediation(models.TextChoices):
    RESTART = "restart", "Restart the engine (reload the model)"
    RESET = "reset", "Reset the GPUs, then reload"
    HARDWARE_REPAIR = "hardware_repair", "Hand off to hardware repair (stays out of service)"
    SWITCH_MODEL = "switch_model", "Switch to another model (a placement's move)"


class PlacementState(models.TextChoices):
    """A re-placement proposal: waiting for on-call, then carried out one node switch at a time."""

    PROPOSED = "proposed", "Waiting for approval"
    RUNNING = "running", "Running"
    DONE = "done", "Done"
    REJECTED = "rejected", "Rejected"
    REFUSED = "refused", "Refused: the fleet changed"
    FAILED = "failed", "Failed"


PLACEMENT_BADGE = {
    PlacementState.PROPOSED: "amber",
    PlacementState.RUNNING: "blue",
    PlacementState.DONE: "green",
    PlacementState.REJECTED: "grey",
    PlacementState.REFUSED: "grey",
    PlacementState.FAILED: "red",
}
OPEN_PLACEMENT_STATES = (PlacementState.PROPOSED, PlacementState.RUNNING)


class CanaryKind(models.TextChoices):
    OK = "ok", "Passed"
    NO_RESPONSE = "no_response", "No response"
    TIMEOUT = "timeout", "Timeout"
    TOKEN_MISMATCH = "token_mismatch", "Token mismatch"
    LOGPROB = "logprob_out_of_range", "Top logprob out of range"
    LATENCY = "latency_spike", "Latency spike"


class ExperimentStatus(models.TextChoices):
    """An experiment's run (recovery.actions.experiments): queued → running → done, failed or cancelled."""

    QUEUED = "queued", "Queued"
    RUNNING = "running", "Running"
    DONE = "done", "Done"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"


EXPERIMENT_BADGE = {
    ExperimentStatus.QUEUED: "blue",
    ExperimentStatus.RUNNING: "amber",
    ExperimentStatus.DONE: "green",
    ExperimentStatus.FAILED: "red",
    ExperimentStatus.CANCELLED: "grey",
}
EXPERIMENT_OPEN = (ExperimentStatus.QUEUED, ExperimentStatus.RUNNING)


class ExpertWorkerState(models.TextChoices):
    """An MoE deployment's expert worker, as the control plane sees it (recovery.actions.moe)."""

    SERVING = "serving", "Serving"
    LOADING = "loading", "Loading experts"
    STANDBY = "standby", "Standby"
    SUSPECT = "suspect", "Not answering"
    DOWN = "down", "Down"
    DRAINED = "drained", "Drained"


EXPERT_WORKER_BADGE = {
    ExpertWorkerState.SERVING: "green",
    ExpertWorkerState.LOADING: "blue",
    ExpertWorkerState.STANDBY: "grey",
    ExpertWorkerState.SUSPECT: "amber",
    ExpertWorkerState.DOWN: "red",
    ExpertWorkerState.DRAINED: "grey",
}
