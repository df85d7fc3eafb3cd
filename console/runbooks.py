"""What to do when a Lifeline alert fires: the one source of the runbook pages at /runbooks/<alert>/.

Every alert in prometheus/*.yml links here through its runbook_url; tests/test_prometheus_rules.py checks that each
has a page. Each runbook says what the alert means, what to look at in the console, and what to do.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Runbook:
    title: str
    meaning: str
    check: tuple[str, ...]
    act: tuple[str, ...]


_SLI = {
    "Availability": (
        "availability",
        "requests failed server-side or shed by the degradation level (a client's 4xx and a client that hung up "
        "do not count)",
        "Incidents (/incidents/): an open incident and its timeline; Degradation (/degradation/): is traffic being "
        "shed, and since when.",
    ),
    "Ttft": (
        "time to first token",
        "requests whose first token came later than the objective's threshold",
        "Cluster (/cluster/): queue depth and load per node; Degradation (/degradation/): capacity against the "
        "required throughput; Checkpoints (/checkpoints/): recoveries re-prefilling long prompts add TTFT.",
    ),
    "Tpot": (
        "time per output token",
        "requests whose tokens after the first came slower than the objective's threshold",
        "Cluster (/cluster/): batch sizes and slow nodes (a node's canary latency against its baseline on its page); "
        "Degradation (/degradation/): level 1 and 3 change batch limits.",
    ),
}


def _burn(sli: str, page: bool) -> Runbook:
    name, bad, where = _SLI[sli]
    speed = (
        "14.4 times the budget's rate over 1 hour and 5 minutes, or 6 times over 6 hours and 30 minutes: at that "
        "pace 2 % to 5 % of a 30-day budget is gone in hours"
        if page
        else "3 times the budget's rate over 1 day and 2 hours, or 1 time over 3 days and 6 hours: the budget will "
        "run out before the window ends if nothing changes"
    )
    return Runbook(
        title=f"The {name} error budget is burning {'fast' if page else 'slowly'}",
        meaning=(
            f"For the model and tier in the alert's labels, the share of {bad} is {speed}. The objective's target "
            "is in prometheus/objectives.yml (and on the console's SLO pages)."
        ),
        check=(
            "SLOs (/slo/): the objective's budget left, its burn-rate table and which rule fires.",
            where,
            "The gateways' /metrics: lifeline_gateway_requests_total by status and code for the model and tier.",
        ),
        act=(
            "If an incident explains it (a node lost, a drain), follow the incident; the burn stops when capacity is "
            "back."
            if page
            else "Open a ticket: find the slow trend (a node slower than its baseline, traffic grown past capacity).",
            "Add capacity (return drained nodes, hot spares) or lower the required throughput in Settings if the "
            "traffic forecast changed.",
            "If the budget was spent on a planned event, an admin records a maintenance window so the report "
            "excludes it.",
        ),
    )


RUNBOOKS: dict[str, Runbook] = {
    f"Lifeline{sli}BudgetBurn{severity}": _burn(sli, severity == "Page")
    for sli in _SLI
    for severity in ("Page", "Ticket")
}
RUNBOOKS.update(
    {
        "LifelineModelNotServed": Runbook(
            "No node serves a model",
            "Every node of the model is down, cordoned, a hot spare, or behind an open circuit breaker: the gateways "
            "answer its requests with 503.",
            (
                "Cluster (/cluster/): the model's nodes, their state, health and breaker.",
                "Drains (/drains/): drains holding its nodes; Incidents (/incidents/): what took them out.",
            ),
            (
                "Promote a hot spare of the model (its node page), or return a drained node once it passes its canary.",
                "If breakers opened on every node at once, suspect a poison request or a bad rollout before the GPUs.",
            ),
        ),
        "LifelineTargetDown": Runbook(
            "A Lifeline process is not scraped",
            "Prometheus could not scrape a control-plane, gateway or node target for 5 minutes.",
            (
                "The console's /healthz (database and Redis checks).",
                "Cluster (/cluster/): a node target down is usually a node down too.",
                "The process's log; for the control plane, that the scrape sends a valid API token.",
            ),
            (
                "Restart the process; for the control plane, issue a token with `manage.py issue_token` and put it in "
                "the scrape config.",
            ),
        ),
        "LifelineControlPlaneMetricsAbsent": Runbook(
            "The control plane's metrics are absent",
            "No series from the control plane's /metrics for 10 minutes: the alerts on node health, drains, canaries "
            "and degradation see nothing.",
            ("The scrape config's lifeline-control-plane job and its token.", "The console's /healthz."),
            ("Fix the scrape (target, token) or start the web process.",),
        ),
        "LifelineGatewayMetricsAbsent": Runbook(
            "No gateway's metrics are scraped",
            "No gateway series for 10 minutes: the SLO burn-rate alerts and the tokens-lost alert see nothing.",
            ("The scrape config's lifeline-gateway job.", "Each gateway's /healthz."),
            ("Fix the scrape or start a gateway (`manage.py gateway`).",),
        ),
        "LifelineDegradedLevel2": Runbook(
            "Degradation level 2 or more for 5 minutes",
            "Capacity is under half the required throughput: best-effort traffic is shed (2), latency objectives are "
            "doubled (3) or new requests refused (4).",
            (
                "Degradation (/degradation/): capacity, required throughput and the level's history.",
                "Incidents (/incidents/): the failure that took the capacity.",
            ),
            (
                "Bring capacity back: promote hot spares, return drained nodes, restart failed ones.",
                "If the required throughput in Settings is stale, correct it (audited).",
            ),
        ),
        "LifelineDegraded": Runbook(
            "Degraded for 15 minutes",
            "Capacity has been under the required throughput for 15 minutes: batches are smaller and the cluster has "
            "not recovered by itself.",
            ("Degradation (/degradation/): which nodes are out and each one's capacity.",),
            ("Return or replace the missing capacity; check that drains are finishing.",),
        ),
        "LifelineCanaryMismatch": Runbook(
            "A canary answered wrong",
            "A node's canary tokens or top logprobs differ from its golden run: silent data corruption, the most "
            "dangerous failure, because users get wrong answers without an error.",
            (
                "The node's page (/nodes/<node>/): its canary results and the golden run it was compared with.",
                "Its incident: the requests it served since its last good canary are listed as possibly wrong.",
            ),
            (
                "Approve the drain Lifeline proposed (reset the GPU), and keep the node out until its canary passes.",
                "If a new golden run was recorded on a bad node, record it again from a healthy one.",
            ),
        ),
        "LifelineTokensLost": Runbook(
            "Tokens were lost",
            "A stream that had started ended in an error, so its client lost the tokens already sent. Lifeline's "
            "promise is zero: every such stream should have moved to another node.",
            (
                "Incidents (/incidents/): the incident of the failure, its requests and what happened to each.",
                "The gateway's log for the request ids.",
            ),
            (
                "Treat it as a bug: keep the incident, the request ids and the gateway's log for the report.",
                "Check that enough nodes of the model were serving to take the streams (checkpoint coverage, "
                "degradation level).",
            ),
        ),
        "LifelineCheckpointCoverageLow": Runbook(
            "Checkpoint coverage under 90 %",
            "Fewer than 90 % of the requests in flight have a usable KV checkpoint on another node: a failure now "
            "re-prefills the rest, with longer stalls.",
            ("Checkpoints (/checkpoints/): coverage, holders and the bytes each holds against its budget.",),
            (
                "Raise the holders' host-DRAM budget or add nodes; long prompts need more.",
                "Check the placement policy in Settings is not 'none'.",
            ),
        ),
        "LifelineHolderImbalance": Runbook(
            "Checkpoint holders out of balance",
            "The most loaded checkpoint holder carries more than 1.5 times the recovery load of the least loaded: a "
            "failure would pile its requests onto a few holders.",
            ("Checkpoints (/checkpoints/): the recovery load L̂ of each holder.",),
            (
                "Use the load-aware placement policy (Settings); check α and β.",
                "A node returning from a drain evens out as new requests arrive.",
            ),
        ),
        "LifelineBreakersOpen": Runbook(
            "Circuit breakers open on more than 10 % of the nodes",
            "Many breakers at once point at a shared cause (a bad rollout, the network, a poison request) rather "
            "than many sick GPUs.",
            (
                "Cluster (/cluster/): which nodes, and the failures their breakers counted (node pages).",
                "Incidents (/incidents/) opened in the same minutes.",
            ),
            (
                "Find the common cause before draining nodes; the auto-cordon breaker in Settings stops automatic "
                "cordons when too many nodes go at once.",
            ),
        ),
        "LifelineDrainStuck": Runbook(
            "A drain is stuck",
            "A drain has not left its state for 15 minutes: its node stays out of service.",
            ("Drains (/drains/): the drain's timeline, its migration command and what it waits for.",),
            (
                "Cancel and propose it again, or finish it by hand (hand the node to hardware repair).",
                "If requests will not migrate, check the gateways (their /healthz) and the target nodes.",
            ),
        ),
        "LifelineGpuXidCritical": Runbook(
            "CRITICAL Xid events on a GPU",
            "The driver reported a CRITICAL Xid (a double-bit ECC error, the GPU off the bus, an NVLink fault, …): "
            "the GPU needs a reset or the node a reboot. Lifeline takes the node out and proposes a drain.",
            ("The node's page (/nodes/<node>/): its Xid events, with what each code calls for.",),
            ("Approve the drain with the remediation the Xid calls for (reset GPU, reboot node).",),
        ),
        # Failures that open incidents of their own (recovery.actions.conditions): each incident links its runbook.
        "LifelineNvlinkDown": Runbook(
            "NVLink down on a node, with no Xid",
            "A heartbeat's GPU telemetry reports NVLink links down on a node whose driver logged no Xid for it: its "
            "tensor-parallel group talks over PCIe, so every step is slower. The node stays in routing.",
            (
                "The node's page (/nodes/<node>/): the GPU table's NVLink column and the step time; its incident: when "
                "the links went down and whether a slow-GPU condition followed.",
            ),
            (
                "Drain the node (reset GPU) when the fleet can spare it; reseat or replace the NVLink bridge or "
                "NVSwitch tray if the links stay down after a reset.",
                "The condition clears by itself when every link reports up again.",
            ),
        ),
        "LifelineGpuSlow": Runbook(
            "A GPU slower than its model for a sustained period",
            "A node's decode steps have run 1.5 times the model's step time for their shape, or slower, for "
            "LIFELINE_SLOW_GPU_S on end (30 s by default). The incident names thermal throttling when the telemetry "
            "shows it; otherwise suspect clocks held down, a PCIe fallback, or a noisy neighbour.",
            (
                "The node's page (/nodes/<node>/): temperature, SM clock against its maximum, clock-event reasons.",
                "Degradation (/degradation/): the capacity the slowdown costs (it counts it already).",
            ),
            (
                "Thermal: check the chassis fans and inlet temperature; drain the node (restart) if it stays hot.",
                "Not thermal: drain it with a GPU reset; hand it to hardware repair if it is slow again after.",
            ),
        ),
        "LifelineNodePartitioned": Runbook(
            "A node partitioned from the control plane",
            "The control plane stopped hearing a node's heartbeats, yet the same session answers it: the network "
            "path its heartbeats take is cut, not the node. It is taken out of routing all the same, since nothing it "
            "holds is coordinated while unheard; its requests moved as for a failure.",
            (
                "Its incident: when the heartbeats stopped and what the probe found.",
                "The network between the node's host and the control plane (switch port, firewall, the node's DNS).",
            ),
            (
                "Restore the path; the node registers again by itself, the condition clears and it returns to "
                "routing once serving.",
                "If it stays cut, drain it (hardware repair) so on-call is not paged again for it.",
            ),
        ),
        "LifelinePoisonRequest": Runbook(
            "A poison request",
            "Several requests with one content key each failed on two nodes: the input, not the nodes, is at fault "
            "(a query of death). No node's breaker counts them, so the fleet stays in service; the clients sending it "
            "get 500 request_failed_on_two_nodes.",
            (
                "Its incident: the request ids, the nodes they failed on and what the engine answered.",
                "The gateways' logs for the request ids: the tenant and key that sent them.",
            ),
            (
                "Report the engine bug with one request id and the engine's answer; block the tenant's key (API keys "
                "page) if it keeps sending it.",
                "The condition clears after ten minutes with no failure of that content.",
            ),
        ),
        "LifelineGatewayLost": Runbook(
            "A gateway lost",
            "A gateway stopped publishing its in-flight requests without leaving cleanly: its process died or its "
            "host is cut off. The streams it held broke; a client that resumes with Last-Event-ID goes on through "
            "another gateway, with nothing lost.",
            (
                "Its incident: the requests it had in flight and the nodes they ran on.",
                "The load balancer's view of the gateway (HAProxy's stats page) and the gateway's log.",
            ),
            (
                "Restart the gateway (`manage.py gateway`); the condition clears when it publishes again.",
                "If clients lost streams, check they resume (clients/resuming.py is the reference client).",
            ),
        ),
        "LifelineStoreAway": Runbook(
            "Redis or the database away",
            "The control plane's store watch could not reach Redis or the database for longer than a heartbeat "
            "interval. While Redis is away no heartbeat, gateway signal or Celery task moves and no failure is handled "
            "(the gateways keep routing on what they last read); while the database is away nothing is recorded.",
            (
                "The console's /healthz (database and Redis checks); the store's own log and host.",
                "Its incident: when it went and when it answered again.",
            ),
            (
                "Bring the store back; Lifeline writes its hot state back to an empty Redis within a second and no "
                "node is marked DOWN for the control plane's own deafness.",
                "If it recurs, look at the store's memory, disk and connection limits.",
            ),
        ),
        "LifelineGpuXidWarnings": Runbook(
            "Many WARN Xid events on a node",
            "Xid events of the warn class (application faults, row remaps, ECC rates) keep coming: not a drain yet, "
            "but a GPU that may fail.",
            ("The node's page (/nodes/<node>/): which codes, on which GPU.",),
            ("Watch it; schedule a reset at a convenient time for row remaps (Xid 63).",),
        ),
    }
)
