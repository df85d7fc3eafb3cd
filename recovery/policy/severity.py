"""An incident's severity, from what it did to users: capacity lost, degradation level reached, requests failed.

SEV1: a third or more of the nodes in service lost, degradation level 3 or more
(batches halved and the latency objective doubled, or new requests refused), or
100 or more requests failed. SEV2: a tenth or more of the nodes lost, any
degradation (level 1 or more), or any request failed. SEV3: the rest, a node
lost while every request it had moved on and the cluster kept its levels.
An incident's severity only rises while it is open: the worst it reached is
what it was.
"""

SEV1, SEV2, SEV3 = "sev1", "sev2", "sev3"
ORDER = (SEV3, SEV2, SEV1)  # least to most severe

SEV1_CAPACITY_LOST = 1 / 3
SEV1_LEVEL = 3
SEV1_FAILED = 100
SEV2_CAPACITY_LOST = 0.10
SEV2_LEVEL = 1
SEV2_FAILED = 1

RULE = (
    "SEV1: a third or more of the nodes in service lost, degradation level 3 or more, or 100+ requests failed; "
    "SEV2: a tenth or more of the nodes lost, any degradation, or any request failed; SEV3: the rest. "
    "It only rises while the incident is open."
)


def severity(capacity_lost: float, peak_level: int, failed: int) -> tuple[str, str]:
    """(severity, why) for an incident that lost `capacity_lost` (a share, 0 to 1) of the nodes in service,
    reached degradation level `peak_level` and failed `failed` requests."""
    lost = f"{capacity_lost:.0%} of the nodes in service lost"
    if capacity_lost >= SEV1_CAPACITY_LOST:
        return SEV1, lost
    if peak_level >= SEV1_LEVEL:
        return SEV1, f"degradation level {peak_level} reached"
    if failed >= SEV1_FAILED:
        return SEV1, f"{failed} requests failed"
    if failed >= SEV2_FAILED:
        return SEV2, f"{failed} request{'s' if failed != 1 else ''} failed"
    if peak_level >= SEV2_LEVEL:
        return SEV2, f"degradation level {peak_level} reached"
    if capacity_lost >= SEV2_CAPACITY_LOST:
        return SEV2, lost
    return SEV3, f"{lost}, no request failed, no degradation"


def worse(a: str, b: str) -> str:
    """The more severe of two severities."""
    return a if ORDER.index(a) >= ORDER.index(b) else b
