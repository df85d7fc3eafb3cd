import datetime as dt
import hashlib
import secrets
import time

from django.conf import settings
from django.db import models
from django.utils import timezone

from recovery.choices import (
    BREAKER_BADGE,
    DRAIN_BADGE,
    EXPERIMENT_BADGE,
    EXPERIMENT_OPEN,
    EXPERT_WORKER_BADGE,
    HEALTH_BADGE,
    INCIDENT_SEVERITY_BADGE,
    INCIDENT_STATUS_BADGE,
    NODE_STATE_BADGE,
    OPEN_DRAIN_STATES,
    PLACEMENT_BADGE,
    AlertStatus,
    BreakerState,
    CanaryKind,
    DrainMode,
    DrainState,
    EventKind,
    ExperimentStatus,
    ExpertWorkerState,
    FailureClass,
    Health,
    HealthChange,
    IncidentSeverity,
    IncidentStatus,
    NodeState,
    PlacementPolicy,
    PlacementState,
    Remediation,
    SloWindow,
    Tier,
)
from recovery.policy import capacity as capacity_policy
from recovery.policy import health as health_policy
from recovery.policy import severity as severity_policy
from recovery.policy import slo as slo_policy
from recovery.protocol import ClusterConfig, ModelLevel


class Cluster(models.Model):
    name = models.CharField(max_length=63, unique=True)
    created_at = models.DateTimeField(default=timezone.now)
    # How the cluster recovers (published to every gateway).
    placement_policy = models.CharField(
        max_length=16, choices=PlacementPolicy.choices, default=PlacementPolicy.LIFELINE
    )
    tau_tokens = models.PositiveIntegerField(
        "τ (tokens)",
        default=512,
        help_text="A checkpointed prefix above this is worth restoring even on a busy holder.",
    )
    theta_factor = models.FloatField(
        "θ factor", default=2.0, help_text="A holder is overloaded above this many times the mean recovery load."
    )
    alpha = models.FloatField(
        "α (pages)", default=1.0, help_text="Weight of checkpoint pages held in the recovery load L̂."
    )
    beta = models.FloatField("β (queue)", default=1.0, help_text="Weight of queue depth in the recovery load L̂.")
    stall_timeout_s = models.FloatField(
        default=5.0, help_text="No byte from a node for this long: the gateway treats it as failed."
    )
    dispatch_accounting = models.BooleanField(
        default=True, help_text="Gateways count a request on its node at dispatch (document 002)."
    )
    incident_window_s = models.FloatField(
        default=60.0, help_text="Failures starting within this window join one incident."
    )
    fault_injection_enabled = models.BooleanField(
        default=False, help_text="Operators may inject faults from the console (staging clusters)."
    )

    # Canaries and health (source document 003), set on the settings page.
    canary_interval_s = models.PositiveIntegerField(
        "canary interval (s)", default=30, help_text="How often each node gets a canary."
    )
    canary_retry_s = models.FloatField(
        "re-check after a failure (s)",
        default=2.0,
        help_text="A node whose last canary failed is checked again this soon.",
    )
    canary_timeout_s = models.FloatField("canary timeout (s)", default=3.0)
    canary_logprob_tolerance = models.FloatField(
        default=0.5, help_text="A top logprob may differ from the golden run by this much."
    )
    canary_latency_factor = models.FloatField(
        default=3.0, help_text="A canary slower than this many times the node's moving baseline fails."
    )
    suspicious_after = models.PositiveSmallIntegerField(
        default=1, help_text="Consecutive failures before SUSPICIOUS (weight 0.5)."
    )
    unhealthy_after = models.PositiveSmallIntegerField(
        default=3, help_text="Consecutive failures before UNHEALTHY (weight 0, drain proposed)."
    )
    xid_burst_window_s = models.FloatField(
        default=10.0, help_text="Xid events on one GPU this close together are one event."
    )
    breaker_threshold = models.PositiveSmallIntegerField(
        default=3, help_text="Consecutive node failures that open a node's circuit breaker."
    )
    breaker_open_s = models.FloatField(
        "breaker open (s)", default=60.0, help_text="How long an open breaker waits before its half-open trial."
    )
    auto_cordon_max_share = models.FloatField(
        default=0.10, help_text="Share of the fleet the health machine may cordon within the window."
    )
    auto_cordon_window_s = models.PositiveIntegerField(default=600)
    # Degradation (document 003): each served model's objective and level are a ModelCapacity; these are shared.
    degradation_margin = models.FloatField(
        default=0.05, help_text="A level falls only when the capacity ratio clears it by this share..."
    )
    degradation_hold_s = models.FloatField("degradation hold (s)", default=30.0, help_text="...for this long.")
    # A fleet that is starting is not a capacity loss (see recovery.actions.capacity).
    startup_grace_s = models.FloatField(
        "start-up grace (s)",
        default=120.0,
        help_text="After the control plane starts, nodes that have not served yet are joining, not lost: "
        "the level is not raised for them until they serve or this long has passed.",
    )
    # Who is told when on-call must act.
    oncall_webhook_url = models.URLField(
        "on-call webhook", blank=True, help_text="POSTed a JSON message for every drain request."
    )
    oncall_emails = models.CharField(
        "on-call e-mail",
        max_length=500,
        blank=True,
        help_text="Comma-separated; on-call users' own addresses are added.",
    )
    drain_propose_again_s = models.PositiveIntegerField(
        "propose a drain again after (s)",
        default=600,
        help_text="A drain cancelled or rejected while its node stays out of service is proposed again this long "
        "after.",
    )

    def __str__(self):
        return self.name

    def gateway_config(self) -> ClusterConfig:
        """What every gateway needs: the recovery settings, and each model's degradation level with its effects (a
        model not listed is at level 0)."""
        models_ = {}
        for row in self.model_capacities.all():
            effects = capacity_policy.EFFECTS[row.degradation_level]
            models_[row.model_key] = ModelLevel(row.degradation_level, tuple(effects.shed_tiers), effects.accept_new)
        return ClusterConfig(
            placement_policy=self.placement_policy,
            tau_tokens=self.tau_tokens,
            theta_factor=self.theta_factor,
            alpha=self.alpha,
            beta=self.beta,
            stall_timeout_s=self.stall_timeout_s,
            dispatch_accounting=self.dispatch_accounting,
            degradation_level=self.state.degradation_level,
            models=models_,
            starting_until=self.starting_until(),
        )

    def starting_until(self) -> float | None:
        """When the start-up grace of the control plane ends (epoch seconds), or None when it has ended."""
        started = self.state.control_plane_started_at
        if started is None:
            return None
        until = started.timestamp() + self.startup_grace_s
        return until if until > time.time() else None

    def returning_nodes(self) -> list["Node"]:
        """The nodes expected back while the control plane starts: they deregistered while alive (a stop of the
        stack sends every node away cleanly) in the RETURNING_WITHIN_S before it started and have not registered
        since. Their models stay served, and they count as joining, not lost, for the start-up grace; a node that
        does not come back is simply not waited for once the grace ends. Empty outside the grace."""
        if self.starting_until() is None:
            return []
        return list(Node.objects.filter(cluster=self, state=NodeState.LEFT, pk__in=self.returning_node_ids()))

    def returning_node_ids(self) -> list[int]:
        """The nodes (pk) that deregistered while alive in the RETURNING_WITHIN_S before the control plane
        started, whatever they did since: those of them still LEFT are the returning nodes."""
        started = self.state.control_plane_started_at
        if started is None:
            return []
        left = NodeTransition.objects.filter(
            node__cluster=self,
            new_state=NodeState.LEFT,
            old_state__in=(NodeState.JOIN, NodeState.SERVING),
            at__gte=started - dt.timedelta(seconds=RETURNING_WITHIN_S),
            at__lte=started,
        )
        return list(left.values_list("node", flat=True).distinct())

    @classmethod
    def default(cls) -> "Cluster":
        cluster, created = cls.objects.select_related("state").get_or_create(name=settings.LIFELINE_CLUSTER_NAME)
        if created:  # the first call on a new database: its state beside it (once, whoever gets there first)
            state = ClusterState(cluster=cluster)
            ClusterState.objects.bulk_create([state], ignore_conflicts=True)
            cluster.state = state
        return cluster


class ClusterState(models.Model):
    """What the control plane writes about a cluster as it runs, apart from the settings people edit (Cluster): the
    fleet's degradation level, the automatic-cordon breaker, when the control plane started. A page saving settings
    never writes these, and the control plane never writes a setting. Written by conditional updates of the columns
    that change (recovery.actions.capacity, recovery.actions.health); `cluster.state` reads it."""

    cluster = models.OneToOneField(Cluster, on_delete=models.CASCADE, primary_key=True, related_name="state")
    degradation_level = models.PositiveSmallIntegerField(
        default=0, help_text="The fleet's worst: the highest level of any served model (ModelCapacity)."
    )
    degradation_changed_at = models.DateTimeField(null=True, blank=True)
    auto_cordon_breaker_open = models.BooleanField(
        default=False, help_text="Automatic cordons are stopped until an admin resets this."
    )
    auto_cordon_breaker_changed_at = models.DateTimeField(null=True, blank=True)
    auto_cordon_breaker_reason = models.TextField(blank=True)
    control_plane_started_at = models.DateTimeField(null=True, blank=True)

    def __str__(self):
        return f"{self.cluster}: level {self.degradation_level}"


class ModelCapacity(models.Model):
    """One served model's throughput objective and its degradation level (document 003, per model).

    Capacity is what the nodes serving this model carry within its latency objectives; the level follows its ratio
    to `required_rps`. A model's lost capacity sheds its own traffic, never another model's: the gateways shed and
    the nodes cut their batch by their own model's level. The cluster's `degradation_level` is the worst of these.
    """

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="model_capacities")
    model_key = models.CharField("model", max_length=64)
    required_rps = models.FloatField(
        "required throughput (req/s)", default=0.0, help_text="0: no throughput objective, no degradation."
    )
    ttft_ms = models.FloatField("TTFT objective (ms)", default=2000.0)
    tpot_ms = models.FloatField("TPOT objective (ms)", default=100.0)
    avg_prompt_tokens = models.PositiveIntegerField("average prompt (tokens)", default=512)
    avg_output_tokens = models.PositiveIntegerField("average output (tokens)", default=256)
    degradation_level = models.PositiveSmallIntegerField(default=0)
    degradation_changed_at = models.DateTimeField(null=True, blank=True)
    degradation_better_since = models.FloatField(
        null=True, blank=True, help_text="Hysteresis: since when a lower level has been justified."
    )

    class Meta:
        ordering = ["model_key"]
        verbose_name_plural = "model capacities"
        constraints = [models.UniqueConstraint(fields=["cluster", "model_key"], name="model_capacity_unique")]

    def __str__(self):
        return f"{self.model_key}: level {self.degradation_level}"

    @classmethod
    def of(cls, model_key: str, cluster: Cluster | None = None) -> "ModelCapacity":
        row, _ = cls.objects.get_or_create(cluster=cluster or Cluster.default(), model_key=model_key)
        return row

    def slo(self) -> "capacity_policy.Slo":
        return capacity_policy.Slo(
            self.ttft_ms, self.tpot_ms, self.required_rps, self.avg_prompt_tokens, self.avg_output_tokens
        )


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
    # Its place in the fabric beyond its rack, as it registered (workers.catalog.Placement): the link
    # its KV takes to another node, which decides between moving the KV and re-prefilling (document 003).
    server = models.CharField(
        max_length=63, blank=True, help_text="The machine whose PCIe bus its GPUs share; blank: one of its own."
    )
    nvl_domain = models.CharField(
        "NVLink domain", max_length=63, blank=True, help_text="The NVLink domain its GPUs belong to; blank: none."
    )
    network = models.CharField(max_length=16, default="infiniband", help_text="The network between servers.")
    # Who runs its machine and where (document 004's trusted providers): a key restricted to some providers or
    # regions is never served on, nor checkpointed to, a node outside them.
    provider = models.CharField(max_length=63, blank=True, help_text="The provider that runs its machine.")
    region = models.CharField(max_length=63, blank=True, help_text="The region its machine is in.")
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
    spare = models.BooleanField(
        default=False, help_text="Hot spare: holds the model, answers canaries, takes no traffic until promoted."
    )
    # Health (source document 003), beside the lifecycle.
    health = models.CharField(max_length=16, choices=Health.choices, default=Health.HEALTHY)
    health_changed_at = models.DateTimeField(default=timezone.now)
    canary_failures = models.PositiveIntegerField(default=0, help_text="Consecutive canary failures.")
    canary_baseline_ms = models.FloatField(
        null=True, blank=True, help_text="Moving average of passing canaries' latency."
    )
    canary_baselines = models.JSONField(
        default=dict,
        blank=True,
        help_text="Per canary prompt, the moving average of its passing answers' latency (ms): what a canary with "
        "that prompt is judged against, since prompts of different lengths take different times.",
    )
    canary_last_at = models.DateTimeField(null=True, blank=True)
    breaker = models.CharField(max_length=16, choices=BreakerState.choices, default=BreakerState.CLOSED)
    breaker_failures = models.PositiveIntegerField(default=0)
    breaker_opened_at = models.FloatField(null=True, blank=True)
    breaker_trial_at = models.FloatField(null=True, blank=True)
    xid_seen_until = models.FloatField(default=0.0, help_text="Newest Xid event taken from heartbeats (epoch seconds).")

    class Meta:
        ordering = ["name"]
        indexes = [models.Index(fields=["state", "state_changed_at"], name="node_state_idx")]

    def __str__(self):
        return self.name

    @property
    def badge(self) -> str:
        return NODE_STATE_BADGE[NodeState(self.state)]

    @property
    def health_badge(self) -> str:
        return HEALTH_BADGE[Health(self.health)]

    @property
    def breaker_badge(self) -> str:
        return BREAKER_BADGE[BreakerState(self.breaker)]

    @property
    def weight(self) -> float:
        """The routing weight every gateway gets for this node (0 when it may take no traffic)."""
        if self.state != NodeState.SERVING:
            return 0.0
        return health_policy.routing_weight(self.health, cordoned=self.cordoned, spare=self.spare, breaker=self.breaker)


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


class Outbox(models.Model):
    """A row whose follow-ups run once, after it committed, from recovery.reactions."""

    reacted_at = models.DateTimeField(
        null=True,
        blank=True,
        db_index=True,
        editable=False,
        help_text="When recovery.reactions ran its follow-ups; empty until then.",
    )

    class Meta:
        abstract = True


class ReactionFailure(models.Model):
    """An outbox row whose reaction raised (recovery.reactions): tried again with backoff until it runs, and after its
    last try given up, with on-call told what did not happen. Deleted once a retry runs it."""

    outbox = models.CharField(max_length=40, help_text="The outbox row's model: NodeTransition, DrainStep, …")
    row_id = models.BigIntegerField()
    tries = models.PositiveIntegerField(default=0)
    error = models.TextField(help_text="What the last try raised.")
    first_at = models.DateTimeField(default=timezone.now)
    next_try_at = models.DateTimeField(null=True, blank=True, help_text="Not tried again before this.")
    gave_up_at = models.DateTimeField(null=True, blank=True, help_text="After the last try: the row counts as handled.")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["outbox", "row_id"], name="one_failure_per_outbox_row")]

    def __str__(self):
        return f"{self.outbox} #{self.row_id}: {self.tries} tries"


class NodeTransition(Outbox):
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
# A node that deregistered this long before the control plane started is expected back at the start
# (Cluster.returning_nodes): a stop and start of the whole stack, an upgrade, a host rebooted.
RETURNING_WITHIN_S = 3600.0


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
    # Data residency (document 004's trusted providers): when either list is set, the key's requests run, and keep
    # their checkpoints, only on nodes of a listed provider or in a listed region. Both empty: any node.
    trusted_providers = models.JSONField(default=list, blank=True)
    trusted_regions = models.JSONField(default=list, blank=True)

    class Meta:
        ordering = ["tenant", "-created_at"]

    def __str__(self):
        return f"{self.prefix}… {self.tenant} ({self.tier})"

    @property
    def restricted(self) -> bool:
        return bool(self.trusted_providers or self.trusted_regions)

    def trust_text(self) -> str:
        """Where its requests may run, in words: "any node", or the providers and regions it trusts."""
        parts = [f"provider {', '.join(self.trusted_providers)}"] if self.trusted_providers else []
        parts += [f"region {', '.join(self.trusted_regions)}"] if self.trusted_regions else []
        return " or ".join(parts) or "any node"

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
    recovered_at = models.DateTimeField(
        "latency recovered at",
        null=True,
        blank=True,
        help_text="Latency recovered: cluster TTFT and TPOT back within 10% of the baseline.",
    )
    capacity_restored_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="Capacity restored: every node involved back in routing, or replaced by a hot spare in service. "
        "The incident is Stable once latency recovered and capacity restored both hold.",
    )
    severity = models.CharField(
        max_length=8, choices=IncidentSeverity.choices, default=IncidentSeverity.SEV3, help_text=severity_policy.RULE
    )
    closed_at = models.DateTimeField(null=True, blank=True)
    acknowledged_at = models.DateTimeField(null=True, blank=True)
    acknowledged_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    commander = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    notes = models.TextField(blank=True)
    nodes = models.ManyToManyField(Node, related_name="incidents", blank=True)
    baseline_ttft_ms = models.FloatField(null=True, blank=True)
    baseline_tpot_ms = models.FloatField(null=True, blank=True)
    recovery_time_s = models.FloatField(
        null=True, blank=True, help_text="Seconds from the first symptom until latency recovered."
    )
    details = models.JSONField(default=dict, blank=True, help_text="Checkpoint distribution before and after, counts.")
    simulated = models.BooleanField(
        default=False, help_text="Generated history (the demo's back-fill, recovery.actions.history): never happened."
    )

    class Meta:
        ordering = ["-opened_at"]
        indexes = [models.Index(fields=["status", "opened_at"], name="incident_status_idx")]

    def __str__(self):
        return f"#{self.pk} {self.title}"

    @property
    def badge(self) -> str:
        return INCIDENT_STATUS_BADGE[IncidentStatus(self.status)]

    @property
    def severity_badge(self) -> str:
        return INCIDENT_SEVERITY_BADGE[IncidentSeverity(self.severity)]


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


class Alert(models.Model):
    """An alert Alertmanager sent to Lifeline's receiver (recovery.actions.alerts), one row per firing: its
    fingerprint and start. Its incident is the one its group (Alertmanager's group key) opened or joined."""

    incident = models.ForeignKey(Incident, on_delete=models.CASCADE, related_name="alerts")
    group_key = models.TextField(help_text="Alertmanager's groupKey: the alerts of one group share an incident.")
    fingerprint = models.CharField(max_length=64)
    name = models.CharField(max_length=200, help_text="Its alertname label.")
    status = models.CharField(max_length=16, choices=AlertStatus.choices)
    severity = models.CharField(max_length=32, blank=True, help_text="Its severity label, as the rule set it.")
    labels = models.JSONField(default=dict)
    annotations = models.JSONField(default=dict, blank=True)
    starts_at = models.DateTimeField()
    ends_at = models.DateTimeField(null=True, blank=True)
    generator_url = models.TextField(blank=True)
    node = models.ForeignKey(
        Node, null=True, blank=True, on_delete=models.SET_NULL, related_name="alerts", help_text="The node it names."
    )
    received_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["starts_at", "id"]
        constraints = [models.UniqueConstraint(fields=["fingerprint", "starts_at"], name="alert_one_row_per_firing")]

    def __str__(self):
        return f"{self.name} ({self.status})"


class Condition(models.Model):
    """A failure that lasts (a link down, a GPU slow, a node partitioned, a poison request, a gateway gone, a store
    away), from its first evidence until it cleared, on the incident it opened or joined (recovery.actions.conditions).
    At most one is open per class and subject: the same evidence again is the same condition."""

    incident = models.ForeignKey(Incident, on_delete=models.CASCADE, related_name="conditions")
    failure_class = models.CharField(max_length=32, choices=FailureClass.choices)
    subject = models.CharField(
        max_length=200, help_text="What failed: a node's or a gateway's name, 'redis' or 'database', a request key."
    )
    node = models.ForeignKey(Node, null=True, blank=True, on_delete=models.SET_NULL, related_name="conditions")
    started_at = models.DateTimeField(help_text="Its first evidence.")
    detected_at = models.DateTimeField(default=timezone.now, help_text="When the control plane recorded it.")
    cleared_at = models.DateTimeField(null=True, blank=True)
    summary = models.TextField()
    cleared_by = models.TextField(blank=True, help_text="The evidence that it cleared.")
    details = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["started_at", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["failure_class", "subject"],
                condition=models.Q(cleared_at__isnull=True),
                name="condition_one_open_per_subject",
            )
        ]

    def __str__(self):
        return f"{self.get_failure_class_display()}: {self.subject}"


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
    # For the SLO rollups (recovery.actions.slo): the HTTP status answered, the degradation level in force, tokens
    # the client never got, whether the row is generated history, and whether it is counted in its minute's rollup.
    http_status = models.PositiveSmallIntegerField(null=True, blank=True)
    degradation_level = models.PositiveSmallIntegerField(null=True, blank=True)
    tokens_lost = models.PositiveIntegerField(default=0)
    simulated = models.BooleanField(default=False)
    rolled_up = models.BooleanField(default=False)

    class Meta:
        ordering = ["-finished_at"]
        indexes = [models.Index(fields=["id"], condition=models.Q(rolled_up=False), name="outcome_not_rolled_up")]

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


class HealthTransition(Outbox):
    """One change of a node's health, breaker, spare status, cordon or model load: the node's health timeline and
    audit log."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="health_transitions")
    kind = models.CharField(max_length=16, choices=HealthChange.choices)
    old = models.CharField(max_length=16, blank=True)
    new = models.CharField(max_length=16)
    at = models.DateTimeField(default=timezone.now, db_index=True)
    cause = models.TextField()
    actor = models.CharField(max_length=150, default="system")
    details = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-at", "-id"]

    def __str__(self):
        return f"{self.node.name} {self.kind}: {self.old or '-'} -> {self.new}"


class CanaryGolden(models.Model):
    """The expected answers to the canary prompts for one model deployment, from nodes known to be good."""

    model_key = models.CharField("model", max_length=64)
    gpu_key = models.CharField("GPU", max_length=32)
    tp = models.PositiveSmallIntegerField()
    prompts = models.JSONField(help_text="[{key, prompt, max_tokens, tokens: [{id, top_logprob}]}]")
    recorded_from = models.CharField(max_length=200, help_text="The node(s) the run came from.")
    recorded_by = models.CharField(max_length=150, default="system")
    recorded_at = models.DateTimeField(default=timezone.now)
    active = models.BooleanField(default=True)

    class Meta:
        ordering = ["-recorded_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["model_key", "gpu_key", "tp"], condition=models.Q(active=True), name="golden_one_active"
            )
        ]

    def __str__(self):
        return f"golden {self.model_key} on {self.tp}x {self.gpu_key} ({self.recorded_at:%Y-%m-%d %H:%M})"

    @property
    def deployment(self) -> str:
        return f"{self.model_key} on {self.tp}× {self.gpu_key}"


class CanaryResult(models.Model):
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="canaries")
    at = models.DateTimeField(default=timezone.now)
    golden = models.ForeignKey(CanaryGolden, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    prompt_key = models.CharField(max_length=32, blank=True)
    passed = models.BooleanField()
    kind = models.CharField(max_length=24, choices=CanaryKind.choices)
    detail = models.TextField(blank=True)
    latency_ms = models.FloatField(null=True, blank=True)
    baseline_ms = models.FloatField(null=True, blank=True)
    trial = models.BooleanField(default=False, help_text="The half-open breaker's one trial call.")
    gpu_ms = models.FloatField(null=True, blank=True, help_text="GPU time the canary cost, by the roofline model.")

    class Meta:
        ordering = ["-at", "-id"]
        indexes = [models.Index(fields=["node", "-at"], name="canary_node_at_idx")]

    def __str__(self):
        return f"{self.node.name} canary {self.kind} at {self.at:%H:%M:%S}"


class XidEvent(models.Model):
    """A burst of Xid events on one GPU (one event for the operator), with what it calls for."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="xid_events")
    gpu_index = models.IntegerField()
    first_at = models.DateTimeField(db_index=True)
    last_at = models.DateTimeField()
    codes = models.JSONField(help_text="{code: count}")
    code = models.PositiveIntegerField(help_text="The code that decides the action.")
    severity = models.CharField(max_length=8)
    meaning = models.CharField(max_length=200)
    action = models.CharField(max_length=200)
    acted = models.BooleanField(default=False, help_text="The health machine made the node UNHEALTHY for it.")

    class Meta:
        ordering = ["-first_at", "-id"]

    def __str__(self):
        return f"{self.node.name} gpu{self.gpu_index} Xid {self.code} ({self.severity})"

    @property
    def count(self) -> int:
        return sum(self.codes.values())


class Drain(models.Model):
    """A request to take a node out of service, its approval, and its run."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="drains")
    state = models.CharField(max_length=16, choices=DrainState.choices, default=DrainState.PROPOSED)
    state_changed_at = models.DateTimeField(default=timezone.now)
    mode = models.CharField(max_length=20, choices=DrainMode.choices, default=DrainMode.IMMEDIATE)
    deadline_s = models.PositiveIntegerField(
        null=True, blank=True, help_text="With mode deadline: seconds after the cordon."
    )
    remediation = models.CharField(max_length=20, choices=Remediation.choices, default=Remediation.RESTART)
    requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    source = models.CharField(max_length=100, help_text="'health machine', or the requesting user.")
    reason = models.TextField()
    evidence = models.JSONField(
        default=dict, blank=True, help_text="Canary failures, Xid events and telemetry at the time of the request."
    )
    blast_radius = models.JSONField(default=dict, blank=True)
    approvals_required = models.PositiveSmallIntegerField(default=1)
    approvals_why = models.TextField(blank=True, help_text="Why a second approver is needed, if one is.")
    created_at = models.DateTimeField(default=timezone.now)
    approved_at = models.DateTimeField(null=True, blank=True)
    cordoned_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    migration_command = models.CharField(max_length=32, blank=True)
    outcome = models.TextField(blank=True)
    incident = models.ForeignKey(
        Incident,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="drains",
        help_text="The incident of the fault that raised it (silent corruption, a CRITICAL Xid).",
    )
    switch_to = models.CharField(
        max_length=64, blank=True, help_text="With remediation switch_model: the model the node serves after it."
    )
    placement = models.ForeignKey(
        "PlacementProposal",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="drains",
        help_text="The approved re-placement this drain is one move of.",
    )
    proposed_again_of = models.ForeignKey(
        "self",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        help_text="The cancelled or rejected drain this one proposes again, its node still out of service.",
    )

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["node"],
                condition=models.Q(state__in=[s.value for s in OPEN_DRAIN_STATES]),
                name="drain_one_open_per_node",
            ),
        ]

    def __str__(self):
        return f"drain #{self.pk} of {self.node.name} ({self.state})"

    @property
    def badge(self) -> str:
        return DRAIN_BADGE[DrainState(self.state)]


class PlacementProposal(models.Model):
    """A re-placement of models on the fleet's nodes (recovery.actions.placement): the plan, the fleet it was made
    against, on-call's decisions, and its run, one node switch (a drain with remediation switch_model) at a time."""

    state = models.CharField(max_length=16, choices=PlacementState.choices, default=PlacementState.PROPOSED)
    state_changed_at = models.DateTimeField(default=timezone.now)
    created_at = models.DateTimeField(default=timezone.now)
    source = models.CharField(max_length=150, help_text="'control plane' for a level's rise, or the asking user.")
    requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    reason = models.TextField()
    model_key = models.CharField("model", max_length=64, blank=True, help_text="The model short of capacity.")
    plan = models.JSONField(help_text="recovery.actions.placement.propose's answer: both sides, moves, evaluation.")
    switches = models.JSONField(help_text="[{node, from, to}] in the order they run.")
    manual = models.JSONField(default=list, blank=True, help_text="Moves no node switch carries out, in words.")
    fleet = models.JSONField(help_text="{node: [model, tp, state]} when the plan was made: checked at approval.")
    approvals_required = models.PositiveSmallIntegerField(default=1)
    approvals_why = models.TextField(blank=True)
    decisions = models.JSONField(default=list, blank=True, help_text="[{user, decision, reason, at}]")
    outcome = models.TextField(blank=True)
    incident = models.ForeignKey(Incident, null=True, blank=True, on_delete=models.SET_NULL, related_name="placements")

    class Meta:
        ordering = ["-created_at"]

    def __str__(self):
        return f"placement #{self.pk} ({self.state})"

    @property
    def badge(self) -> str:
        return PLACEMENT_BADGE[PlacementState(self.state)]


class DrainDecision(models.Model):
    """One person's approval or rejection of a drain, with their reason."""

    APPROVE, REJECT = "approve", "reject"
    drain = models.ForeignKey(Drain, on_delete=models.CASCADE, related_name="decisions")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+")
    decision = models.CharField(max_length=8, choices=[(APPROVE, "Approve"), (REJECT, "Reject")])
    reason = models.TextField()
    at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["at", "id"]
        constraints = [models.UniqueConstraint(fields=["drain", "user"], name="drain_one_decision_per_user")]


class DrainStep(Outbox):
    """One step of a drain: the live progress on its page and its audit trail."""

    drain = models.ForeignKey(Drain, on_delete=models.CASCADE, related_name="steps")
    at = models.DateTimeField(default=timezone.now)
    old_state = models.CharField(max_length=16, blank=True)
    new_state = models.CharField(max_length=16)
    cause = models.TextField()
    actor = models.CharField(max_length=150, default="system")
    details = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["at", "id"]


class DegradationChange(Outbox):
    """A model's degradation level changed: the banner's history."""

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="degradation_changes")
    at = models.DateTimeField(default=timezone.now, db_index=True)
    model_key = models.CharField(
        "model", max_length=64, blank=True, help_text="The model whose level changed (blank: the whole fleet's)."
    )
    old_level = models.PositiveSmallIntegerField()
    new_level = models.PositiveSmallIntegerField()
    ratio = models.FloatField(null=True, blank=True)
    capacity_rps = models.FloatField(null=True, blank=True)
    required_rps = models.FloatField(null=True, blank=True)
    cause = models.TextField()
    details = models.JSONField(default=dict, blank=True)
    simulated = models.BooleanField(
        default=False,
        help_text="Generated history (the demo's back-fill): never the live level, which the cluster row holds.",
    )

    class Meta:
        ordering = ["-at", "-id"]


class Notification(Outbox):
    """Something on-call must see: shown in the console, and sent by webhook and e-mail."""

    at = models.DateTimeField(default=timezone.now, db_index=True)
    kind = models.CharField(max_length=32)
    title = models.CharField(max_length=200)
    body = models.TextField(blank=True)
    url = models.CharField(max_length=200, blank=True)
    severity = models.CharField(
        max_length=8, blank=True, help_text="The severity of the incident it is about; blank: none (an approval asked)."
    )
    delivery = models.JSONField(
        default=dict,
        blank=True,
        help_text="{channel: outcome} for webhook, e-mail and people's own webhooks (personal:<user>: each one's).",
    )

    class Meta:
        ordering = ["-at", "-id"]

    def __str__(self):
        return self.title


class NotificationRule(models.Model):
    """What one on-call engineer (or admin) is told about, and on which channels: e-mail, and a webhook of their own
    (a chat DM's, a paging service's). The console and the team's webhook get every notification; a person without a
    rule is e-mailed everything. Changed through recovery.actions.notify.set_rule."""

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="notification_rule")
    email = models.BooleanField("e-mail me", default=True)
    webhook_url = models.URLField(
        "my webhook", max_length=500, blank=True, help_text="Also POSTed what the rule takes (JSON); blank: none."
    )
    kinds = models.JSONField(
        default=list,
        blank=True,
        help_text="The notification kinds taken (recovery.actions.notify.KINDS); empty: all.",
    )
    severities = models.JSONField(
        default=list,
        blank=True,
        help_text="The incident severities taken (sev1, sev2, sev3); empty: all. A notification about no incident (an "
        "approval asked) is taken by its kind alone.",
    )

    def __str__(self):
        channels = [c for c, on in (("e-mail", self.email), ("webhook", bool(self.webhook_url))) if on]
        what, severities = ", ".join(self.kinds) or "all", ", ".join(self.severities) or "all"
        return f"{self.user}: {' and '.join(channels) or 'nothing'} about {what} ({severities})"


# --- Service-level objectives (recovery.policy.slo has the arithmetic, recovery.actions.slo the changes) -----------
class SloObjective(models.Model):
    """What a model's tier (optionally one tenant of it) is promised: TTFT, TPOT and availability over a window.

    Changed only through recovery.actions.slo (the console form, the JSON API and the Django admin alike): the
    thresholds must be histogram bucket bounds, and every change is audited."""

    model_key = models.CharField("model", max_length=64)
    tier = models.CharField(max_length=16, choices=Tier.choices)
    tenant = models.CharField(max_length=63, blank=True, help_text="Blank: every tenant of the tier.")
    ttft_threshold_ms = models.PositiveIntegerField("TTFT threshold (ms)")
    ttft_percentile = models.FloatField("TTFT percentile", help_text="e.g. 99: 99% of requests within the threshold.")
    tpot_threshold_ms = models.PositiveIntegerField("TPOT threshold (ms)")
    tpot_percentile = models.FloatField("TPOT percentile")
    availability_target = models.FloatField(
        "availability (%)", help_text="Share of valid requests answered without a server-side failure."
    )
    window = models.CharField(max_length=16, choices=SloWindow.choices, default=SloWindow.ROLLING_30D)
    source = models.CharField(max_length=200, blank=True, help_text="Where the figures come from.")
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    updated_by = models.CharField(max_length=150, default="system")

    class Meta:
        ordering = ["model_key", "tier", "tenant"]
        constraints = [models.UniqueConstraint(fields=["model_key", "tier", "tenant"], name="one_objective_per_scope")]
        verbose_name = "service-level objective"

    def __str__(self):
        return f"{self.model_key} · {self.get_tier_display()}" + (f" · {self.tenant}" if self.tenant else "")

    @property
    def targets(self) -> slo_policy.Targets:
        return slo_policy.Targets(float(self.ttft_threshold_ms), float(self.tpot_threshold_ms))


class SloCorrection(models.Model):
    """A period an admin excludes from the objectives (planned maintenance, a misfiring probe), with why."""

    start = models.DateTimeField()
    end = models.DateTimeField()
    reason = models.TextField()
    model_key = models.CharField("model", max_length=64, blank=True, help_text="Blank: every model.")
    tier = models.CharField(max_length=16, choices=Tier.choices, blank=True, help_text="Blank: every tier.")
    created_by = models.CharField(max_length=150)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-start"]

    def __str__(self):
        return f"{self.start:%Y-%m-%d %H:%M}–{self.end:%Y-%m-%d %H:%M}: {self.reason[:60]}"


class RollupCounts(models.Model):
    """One scope's request outcomes as additive counts (recovery.policy.slo's MinuteRollup)."""

    model_key = models.CharField("model", max_length=64)
    tier = models.CharField(max_length=16, choices=Tier.choices)
    tenant = models.CharField(max_length=63)
    valid = models.PositiveIntegerField(default=0)
    good = models.PositiveIntegerField(default=0, help_text="Valid and answered without a server-side failure.")
    server_errors = models.PositiveIntegerField(default=0)
    shed = models.PositiveIntegerField(default=0)
    shed_by_level = models.JSONField(default=dict, help_text="{degradation level: requests shed}")
    client_errors = models.PositiveIntegerField(default=0, help_text="A client's 4xx: not counted against us.")
    client_gone = models.PositiveIntegerField(default=0)
    ttft_valid = models.PositiveIntegerField(default=0)
    ttft_good = models.PositiveIntegerField(default=0)
    tpot_valid = models.PositiveIntegerField(default=0)
    tpot_good = models.PositiveIntegerField(default=0)
    joint_good = models.PositiveIntegerField(default=0, help_text="Answered, and within every latency objective.")
    ttft_hist = models.JSONField(default=list, help_text="Counts per TTFT bucket (recovery.policy.slo bounds).")
    tpot_hist = models.JSONField(default=list, help_text="Counts per TPOT bucket.")
    migrated = models.PositiveIntegerField(default=0)
    tokens_lost = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    simulated = models.PositiveIntegerField(default=0, help_text="Requests of generated history among them.")

    class Meta:
        abstract = True


class SloRollup(RollupCounts):
    """One minute of one model, tier and tenant's request outcomes: every SLO figure is summed from these rows (or
    from their days' sums, SloDayRollup), never from the raw outcomes."""

    minute = models.DateTimeField(help_text="The minute's start (UTC) in which the requests finished.")

    class Meta:
        ordering = ["minute"]
        constraints = [
            models.UniqueConstraint(fields=["model_key", "tier", "tenant", "minute"], name="one_rollup_per_minute")
        ]
        indexes = [models.Index(fields=["minute"], name="rollup_minute")]

    def __str__(self):
        return f"{self.minute:%Y-%m-%d %H:%M} {self.model_key} {self.tier} {self.tenant}: {self.good}/{self.valid}"


class SloDayRollup(RollupCounts):
    """One UTC day of a scope's minutes, summed as they are stored (in the same transaction): a month's report reads
    thirty rows a scope instead of 43,200. Days a correction touches are read from the minutes instead."""

    day = models.DateField(help_text="The UTC day of the minutes summed.")

    class Meta:
        ordering = ["day"]
        constraints = [
            models.UniqueConstraint(fields=["model_key", "tier", "tenant", "day"], name="one_rollup_per_day")
        ]
        indexes = [models.Index(fields=["day"], name="rollup_day")]

    def __str__(self):
        return f"{self.day} {self.model_key} {self.tier} {self.tenant}: {self.good}/{self.valid}"


class SloDayCoverage(models.Model):
    """How many minutes of a UTC day have any rollup: the report's data completeness, without counting the minutes
    of every scope again."""

    day = models.DateField(unique=True)
    minutes = models.PositiveIntegerField(default=0)

    def __str__(self):
        return f"{self.day}: {self.minutes} minutes with rollups"


class SloRollupState(models.Model):
    """The roll-up's progress, one row: locked by each run, so two workers never count an outcome twice."""

    rolled_through_id = models.BigIntegerField(
        default=0, help_text="The highest outcome id counted so far with its id known (COPY on PostgreSQL gives none)."
    )
    outcomes_rolled = models.PositiveBigIntegerField(default=0)
    last_run_at = models.DateTimeField(null=True, blank=True)
    last_batch = models.PositiveIntegerField(default=0)
    pruned_outcomes = models.PositiveBigIntegerField(default=0)
    last_pruned_at = models.DateTimeField(null=True, blank=True)

    def __str__(self):
        return f"rolled {self.outcomes_rolled} outcomes through id {self.rolled_through_id}"


class HistoryBackfill(models.Model):
    """The demo's generated past (recovery.actions.history): one row, claimed by the first run. What the history is
    made from is kept here, so a run cut short resumes with the same one; each day is written in one transaction that
    advances `days_done` by a conditional update, so no day is ever written twice."""

    started_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)
    window_start = models.DateTimeField()
    window_end = models.DateTimeField(help_text="Where live data begins: no generated minute at or after it.")
    days = models.PositiveSmallIntegerField()
    days_done = models.PositiveSmallIntegerField(default=0)
    inputs = models.JSONField(help_text="Seed, fleet, tenants and tiers, rates (recovery.policy.history.Inputs).")
    work_s = models.FloatField(default=0.0, help_text="Seconds spent generating and storing, summed over the days.")
    summary = models.JSONField(default=dict, blank=True, help_text="Requests, shed, failed, moved, incidents, rows.")

    class Meta:
        verbose_name = "generated history"
        verbose_name_plural = "generated history"

    def __str__(self):
        span = f"{self.window_start:%Y-%m-%d}–{self.window_end:%Y-%m-%d}"
        return f"generated history {span}: {self.days_done} of {self.days} days written"


class ExperimentRun(models.Model):
    """One experiment started from the console: a simulator scenario (recovery/sim/scenario.py), every policy on
    every seed, run by a Celery task. Kept after it ends, with its log and results, to be read and compared."""

    name = models.CharField(max_length=200)
    started_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    fleet_source = models.CharField(max_length=16, help_text="live (the registry's nodes) or described.")
    scenario = models.JSONField(help_text="The scenario as run, checked whole before the row was written.")
    status = models.CharField(max_length=16, choices=ExperimentStatus.choices, default=ExperimentStatus.QUEUED)
    progress = models.PositiveSmallIntegerField(default=0, help_text="Percent of the runs done, 0 to 100.")
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    log = models.TextField(blank=True)
    results = models.JSONField(default=dict, blank=True, help_text="Per run summaries, windows, and the charts' lines.")

    class Meta:
        ordering = ["-created_at", "-pk"]

    def __str__(self):
        return f"experiment #{self.pk} {self.name} ({self.status})"

    @property
    def badge(self) -> str:
        return EXPERIMENT_BADGE[ExperimentStatus(self.status)]

    @property
    def is_open(self) -> bool:
        return self.status in EXPERIMENT_OPEN


class MoeDeployment(models.Model):
    """A decoupled MoE deployment (document 001): attention workers that are nodes, and expert workers holding the
    experts. The control plane owns its expert routing table: the one in force is kept here and pushed to every
    attention worker (recovery.actions.moe)."""

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="moe_deployments")
    name = models.SlugField(max_length=64, unique=True)
    model = models.CharField(max_length=64)
    ert = models.JSONField(help_text="The expert routing table in force (workers.moe.ExpertRoutingTable).")
    attention_workers = models.JSONField(default=list, help_text="The names of its attention workers (nodes).")
    details = models.JSONField(
        default=dict,
        blank=True,
        help_text="Tokens per expert since it was registered, the last counts each EW reported, balancedness over "
        "time, and which table version each attention worker took.",
    )
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return f"{self.name} ({self.model})"


class ExpertWorkerNode(models.Model):
    """One expert worker process of an MoE deployment: its address, what it last said it holds and served, and its
    state as the control plane judges it from polling its /moe/status."""

    deployment = models.ForeignKey(MoeDeployment, on_delete=models.CASCADE, related_name="ews")
    name = models.CharField(max_length=64)
    address = models.CharField(max_length=200)
    state = models.CharField(max_length=16, choices=ExpertWorkerState.choices, default=ExpertWorkerState.SERVING)
    state_changed_at = models.DateTimeField(default=timezone.now)
    misses = models.PositiveIntegerField(default=0, help_text="Status polls not answered in a row.")
    last_seen = models.DateTimeField(null=True, blank=True)
    gpu = models.CharField(max_length=32, blank=True)
    primaries = models.JSONField(default=list, blank=True)
    shadows = models.JSONField(default=list, blank=True)
    memory = models.JSONField(default=dict, blank=True, help_text="Bytes its primaries and its shadows take.")
    tokens = models.JSONField(default=dict, blank=True, help_text="Tokens per expert it reported, since it started.")
    refused = models.PositiveIntegerField(default=0)
    pid = models.PositiveIntegerField(
        null=True, blank=True, help_text="Its process id at the last poll: another one means it restarted."
    )
    replacing = models.CharField(max_length=64, blank=True, help_text="The lost EW whose experts it is loading.")
    incident = models.ForeignKey(Incident, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")

    class Meta:
        ordering = ["deployment", "name"]
        constraints = [models.UniqueConstraint(fields=["deployment", "name"], name="ew_unique_name")]

    def __str__(self):
        return f"{self.deployment.name}/{self.name} ({self.state})"

    @property
    def badge(self) -> str:
        return EXPERT_WORKER_BADGE[ExpertWorkerState(self.state)]
