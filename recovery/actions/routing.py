"""What every gateway reads from Redis: the routing table, the deployed models, the keys, the cluster's settings.

Written from the database, the system of record, after the change that moved
them commits; `sync_hot_state` rewrites all of it (after a Redis restart, say).
"""

from recovery import hot
from recovery.choices import NodeState
from recovery.models import ApiKey, Cluster, Node
from recovery.policy import lifecycle
from recovery.protocol import Route, Tenant, Trust


def routing_entries() -> dict[str, dict]:
    """The routing table gateways use: the nodes that may take traffic now, as recovery.protocol.Route writes them."""
    rows = Node.objects.filter(state=NodeState.SERVING).select_related("rack").order_by("name")
    return {
        n.name: Route(
            name=n.name,
            address=n.address,
            model=n.model_key,
            rack=n.rack.name,
            weight=n.weight,
            gpu=n.gpu_key,
            tp=n.tp,
            session=n.session,
            # What the node's engine can do beyond serving: a real engine's node holds no checkpoints.
            capabilities=frozenset(n.capabilities),
            server=n.server,
            nvl_domain=n.nvl_domain,
            network=n.network,
            provider=n.provider,
            region=n.region,
        ).to_wire()
        for n in rows
    }


def deployed_models() -> list[str]:
    """The models of every node that has not left, or left as the stack stopped and is expected back while the
    control plane starts: served now, or coming back (a request for one waits, or is told the fleet is starting,
    rather than told the model does not exist)."""
    present = set(Node.objects.exclude(state=NodeState.LEFT).values_list("model_key", flat=True))
    return sorted(present | {n.model_key for n in Cluster.default().returning_nodes()})


def publish_routing() -> None:
    """The routing table from the database, for every gateway, read and written under one lock. Each change
    publishes after its commit, from whichever process made it; two at once (a spare put back by the worker, a
    node's transition in the web process) could write last a table read before the other's commit, and the gateways
    routed by it until the next change or the 30 s sync (a spare kept taking traffic so). Under the lock, the last
    publish reads after every commit whose publish came before it."""
    with hot.routing_publish():
        hot.publish_routing(routing_entries(), deployed_models())


def publish_cluster_config() -> None:
    """The cluster's recovery settings and degradation level, for every gateway."""
    hot.publish_cluster_config(Cluster.default().gateway_config().to_wire())


def gateway_key_entries() -> dict[str, dict]:
    rows = ApiKey.objects.filter(revoked_at__isnull=True)
    return {
        k.digest: Tenant(
            k.pk,
            k.tenant,
            k.tier,
            Trust(frozenset(k.trusted_providers), frozenset(k.trusted_regions)) if k.restricted else None,
        ).to_wire()
        for k in rows
    }


def publish_gateway_keys() -> None:
    hot.publish_gateway_keys(gateway_key_entries())


def sync_hot_state() -> None:
    """Rebuild what Redis holds from the database."""
    for node in Node.objects.all():
        hot.record_node(node.name, node.session, node.state, node.address, watch=node.state in lifecycle.ALIVE)
    with hot.routing_publish():
        hot.publish_hot_state(
            routing_entries(), deployed_models(), gateway_key_entries(), Cluster.default().gateway_config().to_wire()
        )


def restore_hot_state_if_lost() -> bool:
    """Rewrite the hot state at once when Redis lost it (restarted empty), rather than at the next full sync."""
    if hot.hot_state_present():
        return False
    sync_hot_state()
    return True
