"""Document 003's transfer-or-re-prefill choice sees the fabric: NVLink domains, servers, racks and a failed NVLink.

The figures: Llama-3-8B on eight H100s prefills 8,192 tokens in about 38 ms. Its KV (1 GiB) crosses
NVLink in about 1 ms, InfiniBand inside a rack in 21 ms, PCIe in 38 ms and the shared spine in 64 ms.
"""

from recovery.policy import dispatch
from recovery.policy.dispatch import Interrupted, Survivor
from workers.catalog import Deployment, Placement

FAST = Deployment.of("Llama-3-8B", "H100-SXM", 8)
CONTEXT = 8192


def survivor(name="w", rack="r2", **fabric) -> Survivor:
    return Survivor(name, rack, 0.0, 100_000, FAST, **fabric)


def test_an_nvlink_domain_across_two_racks_transfers_where_the_rack_only_model_re_prefilled():
    """An NVL36x2 domain spans two racks. Placed by rack alone, the KV would cross the spine and lose to
    re-prefill; in one NVLink domain it moves in a millisecond."""
    by_rack = dispatch.migration_method(CONTEXT, CONTEXT, Placement("r1"), survivor())
    assert by_rack[0] == "reprefill" and by_rack[1] > by_rack[2]
    method, transfer_s, reprefill_s = dispatch.migration_method(
        CONTEXT, CONTEXT, Placement("r1", nvl_domain="nvl36x2-a"), survivor(nvl_domain="nvl36x2-a")
    )
    assert method == "transfer" and transfer_s < reprefill_s / 10


def test_a_failed_nvlink_turns_the_same_pair_back_to_re_prefill():
    """Document 003's failure table: NVLink failure, PCIe fallback. Across racks the fallback is the spine."""
    across = dispatch.migration_method(
        CONTEXT, CONTEXT, Placement("r1", nvl_domain="nvl36x2-a"), survivor(nvl_domain="nvl36x2-a", nvlink_down=True)
    )
    assert across[0] == "reprefill"
    # In one server the fallback is PCIe, which loses too at this model's prefill speed.
    in_server = dispatch.migration_method(
        CONTEXT,
        CONTEXT,
        Placement("r1", "dgx-1", "dgx-1-nvl", nvlink_down=True),
        survivor(rack="r1", server="dgx-1", nvl_domain="dgx-1-nvl"),
    )
    assert in_server[0] == "reprefill"
    healthy = dispatch.migration_method(
        CONTEXT,
        CONTEXT,
        Placement("r1", "dgx-1", "dgx-1-nvl"),
        survivor(rack="r1", server="dgx-1", nvl_domain="dgx-1-nvl"),
    )
    assert healthy[0] == "transfer"


def test_recovery_fetches_from_a_holder_in_the_targets_nvlink_domain_and_re_prefills_across_the_spine():
    """Eq. 6's second branch: the holder is overloaded, the least loaded survivor fetches when it pays."""
    lost = Interrupted("r", ("h",), CONTEXT, CONTEXT)

    def plan(holder_fabric: dict, target_fabric: dict) -> dispatch.Decision:
        survivors = {
            "h": Survivor("h", "r1", 50.0, 100_000, FAST, **holder_fabric),  # overloaded: L̂ above θ
            "w": Survivor("w", "r2", 0.0, 100_000, FAST, **target_fabric),
        }
        return dispatch.plan_recovery([lost], survivors, {"dead"}, theta=1.0, tau=CONTEXT)[0]

    rack_only = plan({}, {})
    assert (rack_only.target, rack_only.method) == ("w", "reprefill")
    in_domain = plan({"nvl_domain": "nvl36x2-a"}, {"nvl_domain": "nvl36x2-a"})
    assert (in_domain.target, in_domain.method, in_domain.source) == ("w", "fetch", "h")


def test_of_two_holders_the_one_in_the_targets_nvlink_domain_is_fetched_from():
    """Both in the target's rack: by rack alone a tie, which the preference order would give to the first."""
    lost = Interrupted("r", ("far", "near"), CONTEXT, CONTEXT)
    survivors = {
        "far": Survivor("far", "r1", 50.0, 100_000, FAST),
        "near": Survivor("near", "r1", 50.0, 100_000, FAST, nvl_domain="nvl72-a"),
        "w": Survivor("w", "r1", 0.0, 100_000, FAST, nvl_domain="nvl72-a"),
    }
    decision = dispatch.plan_recovery([lost], survivors, {"dead"}, theta=1.0, tau=CONTEXT)[0]
    assert (decision.target, decision.method, decision.source) == ("w", "fetch", "near")
