"""Circuit breakers (source document 003): one per node, and one for the cluster's automatic cordons.

A node's breaker stops the control plane and the gateways from hammering a
node in a failure loop: closed (traffic flows) → open after `threshold`
consecutive failures of the node itself (a 4xx caused by the client never
counts) → half-open once `open_s` has passed, when exactly one trial call
(a canary) goes through → closed on its success, open again on its failure.

The cluster's breaker stops automatic cordons when too many nodes were
cordoned automatically within a window: a fleet-wide problem (a bad driver,
a network partition, a canary whose golden run went stale) must not let the
health machine drain the whole fleet. Only a person resets it.
"""

import math
from collections.abc import Collection
from dataclasses import dataclass, replace

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"
STATES = (CLOSED, OPEN, HALF_OPEN)
STATE_CODE = {CLOSED: 0, OPEN: 1, HALF_OPEN: 2}  # document 003's gauge


@dataclass(frozen=True)
class Breaker:
    state: str = CLOSED
    failures: int = 0  # consecutive failures of the node
    opened_at: float | None = None
    trial_at: float | None = None  # when the half-open trial call was let through

    def on_failure(self, now: float, threshold: int = 3) -> "Breaker":
        """A failure of the node: count it; open at the threshold, and again after a failed trial."""
        failures = self.failures + 1
        if self.state == HALF_OPEN or (self.state == CLOSED and failures >= threshold):
            return Breaker(OPEN, failures, now, None)
        return replace(self, failures=failures)

    def on_success(self) -> "Breaker":
        """A call the node answered well: a half-open breaker closes; a closed one forgets its count.
        An open breaker ignores it: only its trial call decides."""
        if self.state == OPEN:
            return self
        return Breaker(CLOSED, 0, None, None)

    def to_half_open(self) -> "Breaker":
        """Half-open with no trial out yet: the next call asked for is the trial. For a node that is answering
        again but must prove it before it takes traffic (an UNHEALTHY node whose canary passed)."""
        return Breaker(HALF_OPEN, self.failures, self.opened_at, None)

    def allow(self, now: float, open_s: float = 60.0) -> tuple[bool, "Breaker"]:
        """May a call go to the node now? Returns the answer and the breaker after asking.

        Open until `open_s` has passed since it opened, then half-open with one
        trial call; a half-open breaker whose trial is out lets nothing else through,
        until the trial has been out for `open_s` without an answer (lost), when it
        lets another.
        """
        if self.state == CLOSED:
            return True, self
        if self.state == OPEN:
            if self.opened_at is not None and now - self.opened_at < open_s:
                return False, self
            return True, Breaker(HALF_OPEN, self.failures, self.opened_at, now)
        if self.trial_at is not None and now - self.trial_at < open_s:
            return False, self
        return True, replace(self, trial_at=now)


# --- whose fault is a failed request -------------------------------------------------------------
NODE = "node"  # counts against the node's breaker
REQUEST = "request"  # the request fails wherever it goes: a poison request, nobody's breaker
REPEAT = "repeat"  # the same request again on the same node: counted once already

# How long a request's failures are remembered for the two rules below.
BLAME_WINDOW_S = 600


def blame(node: str, failed_on: Collection[str], counted_here: bool) -> str:
    """Whose fault a request's failure on `node` is, from what the control plane saw of that request.

    `failed_on` is every node the same request (by content) failed on within
    the window, `node` included; `counted_here` says whether it already counted
    against this node. A request that failed on two nodes is the request's
    fault, so one request can never open more than one breaker; the same
    request failing again on one node counts once, so only failures that repeat
    across different requests open a node's breaker.
    """
    if any(other != node for other in failed_on):
        return REQUEST
    if counted_here:
        return REPEAT
    return NODE


def auto_cordons_allowed(node_count: int, max_share: float) -> int:
    """How many automatic cordons a window may hold before the cluster breaker opens.

    The share of the fleet, rounded down, but at least one: on a small fleet a
    share of 10% would otherwise forbid the first cordon, and one sick node is
    exactly what automatic cordons are for.
    """
    if not 0 < max_share <= 1:
        raise ValueError(f"max_share must be in (0, 1], got {max_share}")
    return max(1, math.floor(node_count * max_share + 1e-9))


def cluster_breaker_trips(cordoned_in_window: int, node_count: int, max_share: float) -> bool:
    """True when one more automatic cordon would pass what the window allows."""
    return cordoned_in_window + 1 > auto_cordons_allowed(node_count, max_share)
