"""State changes of the control plane, one module per kind of thing that changes.

Each module imports only the ones listed before it (tests/test_boundaries.py
holds the order); what must follow a committed change elsewhere is a reaction
to its transition row, run from recovery.reactions above all of them.

audit: the audit log.
routing: what every gateway reads from Redis (routing table, models, keys, settings).
notify: telling on-call (console, webhook, e-mail).
keys: gateway API keys.
cluster_settings: the cluster's operating settings.
faults: fault injection on staging nodes.
health: canaries, health states, circuit breakers, cordons, Xid events, hot spares.
live_migration: moving every request off a node, live.
nodes: the node lifecycle (registration, heartbeats, DOWN, LEFT).
incidents: incidents and their timelines, speculative assist.
conditions: failures that last (NVLink down, a slow GPU, a partition, a poison request, a gateway lost, a store away).
alerts: Alertmanager's webhook: its alerts as incidents and their events.
capacity: capacity against the SLOs, and the degradation level.
drains: drains approved by on-call, and their run.
slo: service-level objectives, corrections, and request outcomes rolled up per minute.
streams: what the gateways report (signals and request outcomes).
history: the demo's generated past (rollups, incidents, level changes), marked simulated.
experiments: simulator runs started from the console, their progress, cancel and results.
placement: a placement plan for the live fleet, judged by the simulator (asking changes nothing).
replacement: re-placement proposals, their approval by on-call, and their run as node switches.
moe: MoE deployments: their expert workers watched, the expert routing table healed and pushed, replacements.
"""

ORDER = (
    "audit",
    "routing",
    "notify",
    "keys",
    "faults",
    "health",
    "live_migration",
    "nodes",
    "incidents",
    "conditions",
    "alerts",
    "capacity",
    "cluster_settings",
    "drains",
    "slo",
    "streams",
    "history",
    "experiments",
    "placement",
    "replacement",
    "moe",
)
