"""Names of everything Lifeline keeps in Redis, under one namespace.

No Django here: the gateway uses the same names without loading settings.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    namespace: str

    def _k(self, *parts: str) -> str:
        return ":".join((self.namespace, *parts))

    def node(self, name: str) -> str:
        return self._k("node", name)

    @property
    def heartbeats(self) -> str:
        return self._k("heartbeats")

    @property
    def heartbeats_ingested(self) -> str:
        """String: epoch seconds of the latest heartbeat the control plane took in, from any node."""
        return self._k("heartbeats", "ingested")

    @property
    def heartbeats_deaf(self) -> str:
        """String: epoch seconds since which every watched node has been silent at once (the control plane deaf)."""
        return self._k("heartbeats", "deaf")

    @property
    def heartbeats_resumed(self) -> str:
        """String: epoch seconds at which heartbeats came in again after the control plane took none for a while
        (its web process, or Redis, was away): silence from before then is the control plane's, not the nodes'."""
        return self._k("heartbeats", "resumed")

    @property
    def canary_latency(self) -> str:
        """Hash: node name -> "ratio at": its latest canary's latency over its baseline, and when (epoch seconds).
        The fleet's canaries' slowness now, which one node's latency is judged against."""
        return self._k("canary", "latency")

    @property
    def routing(self) -> str:
        return self._k("routing")

    @property
    def routing_changed(self) -> str:
        """Pub/sub channel: the routing table or the gateway keys changed."""
        return self._k("routing", "changed")

    @property
    def routing_lock(self) -> str:
        """Lock: held by the control-plane process reading the database for the routing table and writing it."""
        return self._k("routing", "lock")

    @property
    def deployed_models(self) -> str:
        """JSON list: every model a registered node serves or is loading, in routing or not.

        A gateway answers 404 for a model outside it, and 503 (try again) for one
        inside it that no node can take right now."""
        return self._k("routing", "models")

    @property
    def gateway_keys(self) -> str:
        return self._k("gateway", "keys")

    @property
    def cluster_config(self) -> str:
        """JSON: placement policy, thresholds (recovery.gateway.table.ClusterConfig)."""
        return self._k("cluster", "config")

    @property
    def hot_state_written(self) -> str:
        """String (a time): the control plane wrote the whole hot state from the database. Gone when Redis lost it."""
        return self._k("hot", "written")

    @property
    def signals(self) -> str:
        """Stream: what gateways saw and did (failure symptoms, request fates, re-placements)."""
        return self._k("stream", "signals")

    def stream(self, request_id: str) -> str:
        """String (JSON), while a gateway relays the request: its tenant, content key, node and holders, for any
        gateway to take its stream over when a client resumes it with Last-Event-ID."""
        return self._k("stream", "request", request_id)

    def stream_over(self, request_id: str) -> str:
        """String, for a while after the request ended: how (a resume of it is answered 404 with that)."""
        return self._k("stream", "over", request_id)

    @property
    def streams_read(self) -> str:
        """String (a time): a control-plane worker last read the gateways' streams (recovery.actions.streams)."""
        return self._k("stream", "read")

    @property
    def outcomes(self) -> str:
        """Stream: one entry per finished request, from the gateways."""
        return self._k("stream", "outcomes")

    @property
    def gateway_commands(self) -> str:
        """Pub/sub channel: the control plane asks gateways to act (a planned migration)."""
        return self._k("gateway", "commands")

    def gateway_inflight(self, gateway: str) -> str:
        """Hash, refreshed each second with a TTL: a gateway's in-flight requests."""
        return self._k("gateway", gateway, "inflight")

    def migration(self, command: str) -> str:
        """Hash: a planned migration's request and each gateway's result."""
        return self._k("migration", command)

    def assist(self, draft_node: str) -> str:
        """The survivor a restarting node's draft model assists."""
        return self._k("assist", draft_node)

    @property
    def gateways(self) -> str:
        """Sorted set: gateway name -> last time it reported its in-flight requests."""
        return self._k("gateways")

    @property
    def capacity(self) -> str:
        """JSON: the last capacity evaluation (recovery.actions.capacity)."""
        return self._k("capacity")

    def telemetry(self, node: str) -> str:
        """List, newest first: a node's GPU readings from its heartbeats (the node page's charts)."""
        return self._k("telemetry", node)

    def checkpoint_history(self, node: str) -> str:
        """List, newest first: the checkpoints a node held, {"at", "checkpoints"}, one per heartbeat (an incident's
        "checkpoints before" is read from it as they were at the failure, not as they are when it is processed)."""
        return self._k("checkpoints", node)

    def request_failures(self, fingerprint: str) -> str:
        """Set, expiring: the nodes a request (by its content's fingerprint) failed on, as gateways reported."""
        return self._k("failures", "request", fingerprint)

    def poison_failures(self, fingerprint: str) -> str:
        """Sorted set, expiring: the requests with one content fingerprint that failed on two nodes, by when
        (recovery.actions.conditions: a poison request)."""
        return self._k("failures", "poison", fingerprint)

    @property
    def poison_last(self) -> str:
        """Sorted set: content fingerprint -> the last time a request with it failed on two nodes."""
        return self._k("failures", "poison-last")

    def node_failures(self, node: str) -> str:
        """Set, expiring: fingerprints of the requests counted against a node's breaker."""
        return self._k("failures", "node", node)
