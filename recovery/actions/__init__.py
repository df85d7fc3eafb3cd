"""State changes of the control plane, one module per kind of thing that changes.

nodes: the node lifecycle (registration, heartbeats, DOWN, LEFT), routing, keys.
incidents: incidents and their timelines.
streams: what the gateways report (signals and request outcomes).
migrations: cordons, planned migrations, the audit log.
health: canaries, health states, circuit breakers, Xid events, hot spares.
drains: drains approved by on-call, and their run.
capacity: capacity against the SLOs, and the degradation level.
notify: telling on-call (console, webhook, e-mail).
"""

from recovery.actions.nodes import (  # noqa: F401 - the node actions are the common entry points
    ClosedSession,
    UnknownNode,
    create_api_key,
    deregister_node,
    mark_long_down_nodes_left,
    mark_silent_nodes_down,
    publish_cluster_config,
    publish_gateway_keys,
    publish_routing,
    record_heartbeat,
    register_node,
    revoke_api_key,
    routing_entries,
    sync_hot_state,
    transition_node,
)
