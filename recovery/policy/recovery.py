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

from recovery.policy import dispatch
from workers.catalog import BLOCK_TOKENS, Deployment, Placement
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
