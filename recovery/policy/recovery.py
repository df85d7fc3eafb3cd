"""Planning a lost node's requests from what a gateway knows: the one reading both gateways share.

The real gateway (recovery/gateway/coordinator.py) and the simulator's gateway
(recovery/sim/fleet.py) must make the same recovery decision from the same
statuses, or the simulator measures a policy nobody runs. `dispatch.plan_recovery`
is already shared; what feeds it was not: how many tokens the holders most
likely have, what a node's status says about its free KV blocks, and θ from the
survivors. Each lives here once, and both gateways call it
(tests/recovery/sim/test_replay.py replays one log through both).
"""

import math
from collections.abc import Collection, Mapping, Sequence

from recovery.policy import dispatch, load
from workers.catalog import BLOCK_TOKENS, HOST_TO_GPU_LINK, Deployment, Placement, kv_transfer_s, node_link
from workers.protocol import RoutingStatus

# A lost node's checkpoints of requests running elsewhere are re-placed once every request it was serving has its
# first token after its move (or has ended), and at the latest this long after the node was lost. Re-placing makes
# each serving node resend every block to a new holder, and it guards only against a second failure: the stalled
# streams come first. Done at once, the resent pages held the serving nodes' links while the moved requests' KV was
# fetched (the simulator's stalls shortened when it waited); on the real emulated cluster, whose moves are slowed by
# its shared CPUs, waiting changed nothing measurable (benchmarks/README.md, "sim_validation").
REPLACE_HOLDERS_WITHIN_S = 1.0


def checkpointed_estimate(
    holders: Sequence[str], has_output: bool, context_tokens: int, prefill_chunks_checkpointed: bool
) -> int:
    """KV tokens a request's holders most likely have: its whole blocks but the last, which may still be in
    transit when the node fails.

    The gateway does not hear of each page a holder receives, so it estimates;
    the holder restores what it really has. Before the first token a holder has
    pages only where completed prefill chunks are checkpointed (Lifeline's);
    elsewhere the prompt's blocks go out once prefill is done.
    """
    if not holders:
        return 0
    if not has_output and not prefill_chunks_checkpointed:
        return 0
    return max(context_tokens // BLOCK_TOKENS - 1, 0) * BLOCK_TOKENS


def free_blocks(status: RoutingStatus, deployment: Deployment) -> int:
    """Free KV blocks as the node's status says; the whole cache only when it has not said.

    A node that reports 0 free blocks is full, not empty: only a missing total
    (a node not heard from, or one that cannot report it) reads as the cache
    its deployment has.
    """
    if not status.kv_blocks_total:
        return deployment.kv_blocks
    return max(status.kv_blocks_total - status.kv_blocks_used, 0)


def survivor(
    name: str, where: Placement, l_hat: float, status: RoutingStatus, deployment: Deployment
) -> dispatch.Survivor:
    """A node as a recovery target: its L̂, its free blocks by its status, and its place in the fabric, which
    decides which holder a fetch comes from."""
    return dispatch.Survivor(
        name=name,
        rack=where.rack,
        l_hat=l_hat,
        free_blocks=free_blocks(status, deployment),
        deployment=deployment,
        server=where.server,
        nvl_domain=where.nvl_domain,
        network=where.network,
        nvlink_down=where.nvlink_down,
    )


def plan(
    stranded: Sequence[dispatch.Interrupted],
    survivors: Mapping[str, dispatch.Survivor],
    failed: Collection[str],
    theta_factor: float,
    tau: int,
    alpha: float,
    beta: float,
) -> list[dispatch.Decision]:
    """Every stranded request's decision in one pass (Algorithm 2), θ from the survivors' mean L̂.

    A `theta_factor` of infinity makes θ infinite, so every request goes to its
    holder whatever its load (DéjàVu's dispatch, an ablation). It is set
    outright: infinity times an idle fleet's mean L̂ of 0 is NaN, θ would fall
    to theta_for's floor of 1, and the holder's first restore would make it
    overloaded for the next request. Raises dispatch.NoSurvivors when requests
    are stranded and no node is left.
    """
    if math.isinf(theta_factor):
        theta = math.inf
    else:
        theta = dispatch.theta_for([s.l_hat for s in survivors.values()], theta_factor)
    return dispatch.plan_recovery(stranded, survivors, failed, theta, tau, alpha, beta)


# Nodes a soonest plan weighs besides a request's holders: the least costly by the statuses as the plan starts,
# so a plan is O(nodes + requests × this) and a thousand requests over hundreds of survivors stays in milliseconds.
SOONEST_POOL = 16


def plan_soonest(
    stranded: Sequence[dispatch.Interrupted],
    survivors: Mapping[str, dispatch.Survivor],
    statuses: Mapping[str, RoutingStatus],
    failed: Collection[str],
) -> list[dispatch.Decision]:
    """Every stranded request where its next token comes soonest: an experiment beside eq. 6 (`plan`).

    Eq. 6 restores a request on its holder unless the holder's recovery load L̂ (the checkpoints it holds and its
    queue) passes θ, twice the fleet's mean. L̂ does not see what keeps a restored request from its next token: the
    prefill work queued ahead of it on that node. On 256 simulated nodes a holder's queue held a restored request
    for up to half a second while idle nodes were a few milliseconds of KV transfer away (benchmarks/README.md).
    This weighs, per request, the time to its next token by the gateway's own routing cost (load.routing_cost: the
    node's queued prefill, its decode step and its KV load, with the work this plan already gave it) for

    - restoring on each surviving holder: the uncheckpointed tail's prefill there, after the KV's copy from the
      holder's host memory (HOST_TO_GPU_LINK);
    - fetching to each of the SOONEST_POOL least costly survivors: the same tail there, after the KV's transfer
      over the link between them (workers.catalog.node_link) or out of the holder's host memory, whichever is
      slower, when it has the free blocks for the whole context;
    - re-prefilling the whole context on one of them, when it has the free blocks;

    and takes the soonest; ties go to restoring, then to the name. Requests are planned in order, each seeing the
    ones before it (`load.Pending`). Raises dispatch.NoSurvivors as `plan` does."""
    failed = set(failed)
    alive = {n: s for n, s in survivors.items() if s.alive and n not in failed and n in statuses}
    if stranded and not alive:
        raise dispatch.NoSurvivors(
            f"no surviving node can take {len(stranded)} interrupted requests: every node is failed or dead"
        )
    pending = {n: load.Pending() for n in alive}
    free = {n: s.free_blocks for n, s in alive.items()}

    def ready_s(name: str, tokens: int) -> float:
        return load.routing_cost(statuses[name], pending[name], alive[name].deployment, max(tokens, 1))

    pool = sorted(alive, key=lambda n: (ready_s(n, 1), n))[:SOONEST_POOL]
    decisions = []
    for r in stranded:
        tokens = r.context_tokens
        kv = max(0, min(r.checkpointed_tokens, tokens)) if r.holders else 0
        holders = [h for h in r.holders if h in alive] if kv else []
        options: list[tuple[float, int, str, str, str | None]] = []  # (seconds, preference, target, method, source)
        for h in holders:
            copy_s = kv_transfer_s(alive[h].deployment.model.kv_bytes_per_token * kv, HOST_TO_GPU_LINK)
            options.append((ready_s(h, tokens - kv) + copy_s, 0, h, "restore", h))
        for w in pool:
            if free[w] < dispatch.blocks(tokens):
                continue
            target = alive[w]
            for h in holders:
                if h != w:
                    link, share = node_link(alive[h].placement, target.placement, target.deployment.gpu)
                    size = target.deployment.model.kv_bytes_per_token * kv
                    # The pages leave the holder's host memory over its PCIe too: the slower leg sets the pace.
                    move_s = max(kv_transfer_s(size, link, share), kv_transfer_s(size, HOST_TO_GPU_LINK))
                    options.append((ready_s(w, tokens - kv) + move_s, 1, w, "fetch", h))
            options.append((ready_s(w, tokens), 2, w, "reprefill", None))
        if not options:  # no holder alive and no pooled node with room: the least costly, as eq. 6 would
            options.append((ready_s(pool[0], tokens), 2, pool[0], "reprefill", None))
        seconds, _, target_name, method, source = min(options, key=lambda o: (o[0], o[1], o[2]))
        lost = [h for h in r.holders if h not in alive]
        why = f"next token soonest: {method} on {target_name} in {seconds * 1000:.1f} ms"
        if method != "reprefill":
            why += f" ({kv} tokens from {source})"
        if lost:
            why = f"holder {', '.join(lost)} failed too; {why}"
        decisions.append(dispatch.Decision(r.request_id, target_name, method, source, why))
        uncomputed = tokens if method == "reprefill" else tokens - kv
        pending[target_name].add(uncomputed)
        free[target_name] = max(0, free[target_name] - dispatch.blocks(tokens))
    return decisions
