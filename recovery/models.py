import hashlib
import secrets

from django.conf import settings
from django.db import models
from django.utils import timezone

from recovery.choices import INCIDENT_STATUS_BADGE, EventKind, IncidentStatus, NODE_STATE_BADGE, NodeState, PlacementPolicy, Tier


class Cluster(models.Model):
    name = models.CharField(max_length=63, unique=True)
    created_at = models.DateTimeField(default=timezone.now)
    # How the cluster recovers (published to every gateway).
    placement_policy = models.CharField(max_length=16, choices=PlacementPolicy.choices, default=PlacementPolicy.LIFELINE)
    tau_tokens = models.PositiveIntegerField("τ (tokens)", default=512, help_text="A checkpointed prefix above this is worth restoring even on a busy holder.")
    theta_factor = models.FloatField("θ factor", default=2.0, help_text="A holder is overloaded above this many times the mean recovery load.")
    alpha = models.FloatField("α (pages)", default=1.0, help_text="Weight of checkpoint pages held in the recovery load L̂.")
    beta = models.FloatField("β (queue)", default=1.0, help_text="Weight of queue depth in the recovery load L̂.")
    stall_timeout_s = models.FloatField(default=5.0, help_text="No byte from a node for this long: the gateway treats it as failed.")
    dispatch_accounting = models.BooleanField(default=True, help_text="Gateways count a request on its node at dispatch (document 002).")
    incident_window_s = models.FloatField(default=60.0, help_text="Failures starting within this window join one incident.")
    fault_injection_enabled = models.BooleanField(default=False, help_text="Operators may inject faults from the console (staging clusters).")

    def __str__(self):
        return self.name

    def gateway_config(self) -> dict:
        return {
            "placement_policy": self.placement_policy, "tau_tokens": self.tau_tokens, "theta_factor": self.theta_factor,
            "alpha": self.alpha, "beta": self.beta, "stall_timeout_s": self.stall_timeout_s,
            "dispatch_accounting": self.dispatch_accounting,
        }

    @classmethod
    def default(cls) -> "Cluster":
        cluster, _ = cls.objects.get_or_create(name=settings.LIFELINE_CLUSTER_NAME)
        return cluster


class Rack(models.Model):
    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="racks")
    name = models.CharField(max_length=63)

    class Meta:
        ordering = ["name"]
        constraints = [models.UniqueConstraint(fields=["cluster", "name"], name="rack_unique_name")]

    def __str__(self):
        return self.name


class Node(models.Model):
    """A serving node: one engine on a tensor-parallel group of GPUs.

    The row outlives the node's processes: each start is a new session that
    registers again under the same name, so the history stays in one place.
    """

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="nodes")
    rack = models.ForeignKey(Rack, on_delete=models.PROTECT, related_name="nodes")
    name = models.CharField(max_length=63, unique=True)
    state = models.CharField(max_length=16, choices=NodeState.choices, default=NodeState.JOIN)
    state_changed_at = models.DateTimeField(default=timezone.now)
    session = models.CharField(max_length=64, help_text="Current session; a new one starts at every process start.")
    address = models.CharField(max_length=200, help_text="Base URL of the node agent.")
    host = models.CharField(max_length=255, blank=True)
    pid = models.PositiveIntegerField(null=True, blank=True)
    model_key = models.CharField("model", max_length=64)
    gpu_key = models.CharField("GPU", max_length=32)
    tp = models.PositiveSmallIntegerField("tensor-parallel degree", default=1)
    engine = models.CharField(max_length=32, default="emulated")
    capabilities = models.JSONField(default=list, blank=True)
    registered_at = models.DateTimeField(default=timezone.now, help_text="First registration.")
    session_started_at = models.DateTimeField(default=timezone.now)
    last_seen_at = models.DateTimeField(null=True, blank=True, help_text="Last heartbeat, as of the last state change.")
    cordoned = models.BooleanField(default=False, help_text="Takes no new requests (a drain, or an operator's hand).")

    class Meta:
        ordering = ["name"]
        indexes = [models.Index(fields=["state", "state_changed_at"], name="node_state_idx")]

    def __str__(self):
        return self.name

    @property
    def badge(self) -> str:
        return NODE_STATE_BADGE[NodeState(self.state)]


class Gpu(models.Model):
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveSmallIntegerField()
    uuid = models.CharField(max_length=80)
    name = models.CharField(max_length=80)
    memory_bytes = models.BigIntegerField()

    class Meta:
        ordering = ["node", "index"]
        constraints = [models.UniqueConstraint(fields=["node", "index"], name="gpu_unique_index")]

    def __str__(self):
        return f"{self.node.name}/gpu{self.index}"


class NodeTransition(models.Model):
    """One lifecycle step of a node: the audit log, the timeline and the outbox."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="transitions")
    session = models.CharField(max_length=64)
    old_state = models.CharField(max_length=16, choices=NodeState.choices, blank=True)
    new_state = models.CharField(max_length=16, choices=NodeState.choices)
    at = models.DateTimeField(default=timezone.now, db_index=True)
    cause = models.TextField()
    actor = models.CharField(max_length=150, default="system", help_text="'system' or the user who acted.")

    class Meta:
        ordering = ["-at", "-id"]

    def __str__(self):
        return f"{self.node.name}: {self.old_state or '-'} -> {self.new_state} at {self.at:%H:%M:%S.%f}"


GATEWAY_KEY_PREFIX = "llk_"


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class ApiKey(models.Model):
    """A gateway API key: it names the tenant and the priority tier of its requests."""

    tenant = models.CharField(max_length=63)
    tier = models.CharField(max_length=16, choices=Tier.choices, default=Tier.STANDARD)
    label = models.CharField(max_length=100, blank=True)
    prefix = models.CharField(max_length=12)
    digest = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(default=timezone.now)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["tenant", "-created_at"]

    def __str__(self):
        return f"{self.prefix}… {self.tenant} ({self.tier})"

    @staticmethod
    def new_secret() -> str:
        return GATEWAY_KEY_PREFIX + secrets.token_urlsafe(32)


class Incident(models.Model):
    """One failure event (failures starting within a short window group together) and its recovery."""

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="incidents")
    title = models.CharField(max_length=200)
    status = models.CharField(max_length=16, choices=IncidentStatus.choices, default=IncidentStatus.ACTIVE)
    status_changed_at = models.DateTimeField(default=timezone.now)
    opened_at = models.DateTimeField(default=timezone.now, help_text="The first symptom.")
    detected_at = models.DateTimeField(null=True, blank=True, help_text="The control plane confirmed the failure.")
    recovered_at = models.DateTimeField(null=True, blank=True, help_text="Cluster TTFT and TPOT back within 10% of the baseline.")
    closed_at = models.DateTimeField(null=True, blank=True)
    acknowledged_at = models.DateTimeField(null=True, blank=True)
    acknowledged_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    commander = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    notes = models.TextField(blank=True)
    nodes = models.ManyToManyField(Node, related_name="incidents", blank=True)
    baseline_ttft_ms = models.FloatField(null=True, blank=True)
    baseline_tpot_ms = models.FloatField(null=True, blank=True)
    recovery_time_s = models.FloatField(null=True, blank=True)
    details = models.JSONField(default=dict, blank=True, help_text="Checkpoint distribution before and after, counts.")

    class Meta:
        ordering = ["-opened_at"]
        indexes = [models.Index(fields=["status", "opened_at"], name="incident_status_idx")]

    def __str__(self):
        return f"#{self.pk} {self.title}"

    @property
    def badge(self) -> str:
        return INCIDENT_STATUS_BADGE[IncidentStatus(self.status)]


class IncidentEvent(models.Model):
    """One line of an incident's timeline, with its millisecond timestamp and cause."""

    incident = models.ForeignKey(Incident, on_delete=models.CASCADE, related_name="events")
    at = models.DateTimeField(db_index=True)
    kind = models.CharField(max_length=32, choices=EventKind.choices)
    source = models.CharField(max_length=100, help_text="Which gateway, the control plane, a node, or a person.")
    node = models.ForeignKey(Node, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    request_id = models.CharField(max_length=128, blank=True)
    description = models.TextField()
    details = models.JSONField(default=dict, blank=True)
    actor = models.CharField(max_length=150, default="system")

    class Meta:
        ordering = ["at", "id"]

    def __str__(self):
        return f"{self.at:%H:%M:%S.%f} {self.kind}: {self.description}"


class RequestOutcome(models.Model):
    """How one request went, as its gateway reported it: the raw material of recovery times and SLA reports."""

    request_id = models.CharField(max_length=128, db_index=True)
    gateway = models.CharField(max_length=100)
    tenant = models.CharField(max_length=63)
    tier = models.CharField(max_length=16, choices=Tier.choices)
    model_key = models.CharField(max_length=64)
    node = models.CharField(max_length=63, blank=True)
    nodes = models.JSONField(default=list)
    status = models.CharField(max_length=16)  # ok, rejected, error, client_gone
    finish_reason = models.CharField(max_length=16, blank=True)
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    ttft_ms = models.FloatField(null=True, blank=True)
    tpot_ms = models.FloatField(null=True, blank=True)
    e2e_ms = models.FloatField(null=True, blank=True)
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField(db_index=True)
    migrations = models.JSONField(default=list, blank=True)
    incident = models.ForeignKey(Incident, null=True, blank=True, on_delete=models.SET_NULL, related_name="outcomes")

    class Meta:
        ordering = ["-finished_at"]

    def __str__(self):
        return f"{self.request_id} ({self.status})"


class AuditEntry(models.Model):
    """Every human action, and every automatic one an operator may question: who, when, what, why."""

    at = models.DateTimeField(default=timezone.now, db_index=True)
    actor = models.CharField(max_length=150, help_text="A user name, or 'system'.")
    action = models.CharField(max_length=64)
    target = models.CharField(max_length=200, help_text="What it was done to, e.g. node:node-03.")
    reason = models.TextField(blank=True)
    details = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-at", "-id"]
        verbose_name_plural = "audit log"

    def __str__(self):
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor} {self.action} {self.target}"
