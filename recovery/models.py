import hashlib
import secrets

from django.conf import settings
from django.db import models
from django.utils import timezone

from recovery.choices import NODE_STATE_BADGE, NodeState, Tier


class Cluster(models.Model):
    name = models.CharField(max_length=63, unique=True)
    created_at = models.DateTimeField(default=timezone.now)

    def __str__(self):
        return self.name

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
