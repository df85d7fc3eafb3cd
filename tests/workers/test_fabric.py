"""The fabric model: which link KV takes between two nodes, and how a node says where it sits."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workers import catalog, protocol
from workers.catalog import Placement, node_link
from workers.checkpoint import Peer
from workers.node import parse_args

H100 = catalog.GPUS["H100-SXM"]
A100 = catalog.GPUS["A100-80GB"]
L40S = catalog.GPUS["L40S"]
THIRD = catalog.LOADED_LINK_FACTOR


@pytest.mark.parametrize(
    "a, b, gpu, expected",
    [
        # Nodes that say nothing but their rack are linked as before the fabric was modelled.
        (Placement("r1"), Placement("r1"), H100, ("infiniband", 1.0)),
        (Placement("r1"), Placement("r2"), H100, ("infiniband", THIRD)),
        # One NVLink domain: the GPU's NVLink, in one server (a DGX) or across trays and racks (NVL72, NVL36x2).
        (Placement("r1", "s1", "dgx-1"), Placement("r1", "s1", "dgx-1"), H100, ("nvlink", 1.0)),
        (Placement("r1", "t1", "nvl72-a"), Placement("r1", "t2", "nvl72-a"), H100, ("nvlink", 1.0)),
        (Placement("r1", nvl_domain="nvl36x2"), Placement("r2", nvl_domain="nvl36x2"), H100, ("nvlink", 1.0)),
        (Placement("r1", nvl_domain="dgx-a"), Placement("r1", nvl_domain="dgx-a"), A100, ("nvswitch", 1.0)),
        # One server, not one domain: PCIe between its GPUs.
        (Placement("r1", "s1"), Placement("r1", "s1"), H100, ("pcie", 1.0)),
        (Placement("r1", "s1", "half-a"), Placement("r1", "s1", "half-b"), H100, ("pcie", 1.0)),
        # A PCIe card has no NVLink, whatever domain it is said to be in.
        (Placement("r1", "s1", "x"), Placement("r1", "s1", "x"), L40S, ("pcie", 1.0)),
        (Placement("r1", "s1", "x"), Placement("r1", "s2", "x"), L40S, ("infiniband", 1.0)),
        # Other servers: the network, at full rate through the leaf, a third through the shared spine.
        (Placement("r1", "s1"), Placement("r1", "s2"), H100, ("infiniband", 1.0)),
        (Placement("r1", "s1", network="roce"), Placement("r1", "s2", network="roce"), H100, ("roce", 1.0)),
        (Placement("r1", network="roce"), Placement("r2", network="roce"), H100, ("roce", THIRD)),
        (Placement("r1", network="roce"), Placement("r1"), H100, ("other", 1.0)),  # no RDMA between RoCE and IB
        # NVLink down at either end: the next path, PCIe in one server, the network beyond it.
        (Placement("r1", "s1", "dgx-1", nvlink_down=True), Placement("r1", "s1", "dgx-1"), H100, ("pcie", 1.0)),
        (
            Placement("r1", "t1", "nvl72-a"),
            Placement("r1", "t2", "nvl72-a", nvlink_down=True),
            H100,
            ("infiniband", 1.0),
        ),
        (
            Placement("r1", nvl_domain="x", nvlink_down=True),
            Placement("r2", nvl_domain="x"),
            H100,
            ("infiniband", THIRD),
        ),
    ],
)
def test_the_link_between_two_placements(a, b, gpu, expected):
    assert node_link(a, b, gpu) == expected


placements = st.builds(
    Placement,
    rack=st.sampled_from(["r1", "r2"]),
    server=st.sampled_from(["", "s1", "s2"]),
    nvl_domain=st.sampled_from(["", "d1", "d2"]),
    network=st.sampled_from(catalog.NETWORKS),
    nvlink_down=st.booleans(),
)


@given(placements, placements, st.sampled_from(sorted(catalog.GPUS)))
def test_a_link_is_the_same_both_ways_and_never_faster_than_the_gpus_own(a, b, gpu_key):
    gpu = catalog.GPUS[gpu_key]
    link, share = node_link(a, b, gpu)
    assert (link, share) == node_link(b, a, gpu)
    assert link in catalog.LINK_GBPS and 0 < share <= 1
    assert catalog.LINK_GBPS[link] * share <= max(catalog.LINK_GBPS[gpu.link], catalog.LINK_GBPS["infiniband"])


def test_transfer_time_follows_the_link_and_its_share():
    nbytes = catalog.kv_bytes(catalog.model("Qwen3-32B"), 4096)
    over_nvlink = catalog.kv_transfer_s(
        nbytes, *node_link(Placement("r1", nvl_domain="d"), Placement("r1", nvl_domain="d"), H100)
    )
    across_spine = catalog.kv_transfer_s(nbytes, *node_link(Placement("r1"), Placement("r2"), H100))
    assert over_nvlink == pytest.approx(nbytes / 900e9)
    assert across_spine == pytest.approx(3 * nbytes / 50e9)


# --- how a node says where it sits ------------------------------------------------------------


def registration(**extra) -> dict:
    return {
        "name": "n1",
        "session": "s" * 16,
        "address": "http://127.0.0.1:9001",
        "rack": "rack-a",
        "model": "Qwen3-32B",
        "gpu": "H100-SXM",
        "tp": 2,
        "gpus": [],
        "pid": 1,
        "host": "gpu-host-17",
        **extra,
    }


def test_a_node_that_does_not_say_is_alone_on_its_server_on_infiniband():
    reg = protocol.Registration.parse(registration())  # as a node from before the fabric was modelled sends it
    assert (reg.server, reg.nvl_domain, reg.network) == ("", "", "infiniband")


def test_a_registration_carries_the_nodes_place_in_the_fabric_both_ways():
    reg = protocol.Registration.parse(registration(server="dgx-07", nvl_domain="nvl72-a", network="roce"))
    assert (reg.server, reg.nvl_domain, reg.network) == ("dgx-07", "nvl72-a", "roce")
    assert protocol.Registration.parse(json.loads(json.dumps(reg.to_json()))) == reg  # as it goes on the wire


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"network": "ethernet"}, "network"),
        ({"server": "dgx 07"}, "server"),
        ({"nvl_domain": 72}, "nvl_domain"),
    ],
)
def test_a_bad_place_in_the_fabric_is_refused_by_name(extra, field):
    with pytest.raises(protocol.ProtocolError) as refused:
        protocol.Registration.parse(registration(**extra))
    assert refused.value.field == field


def test_a_peer_from_an_older_gateway_is_placed_by_its_rack_alone():
    peer = Peer.parse({"name": "b", "address": "http://10.0.0.2:8200", "rack": "rack-b"}, "target")
    assert peer.placement == Placement("rack-b")
    full = Peer("b", "http://10.0.0.2:8200", "rack-b", "dgx-2", "nvl72-a", "roce")
    assert Peer.parse(full.to_json(), "target") == full
    with pytest.raises(ValueError, match="target.network: 'ethernet' is not a network"):
        Peer.parse({**full.to_json(), "network": "ethernet"}, "target")


def test_node_flags_place_it_and_keep_todays_defaults():
    args = parse_args(["--name", "n1"])
    assert (args.server, args.nvl_domain, args.network) == ("", "", "infiniband")
    args = parse_args(["--name", "n1", "--server", "dgx-07", "--nvl-domain", "dgx-07-nvl", "--network", "roce"])
    assert (args.server, args.nvl_domain, args.network) == ("dgx-07", "dgx-07-nvl", "roce")


def test_an_nvlink_domain_on_a_pcie_card_is_refused_at_start(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--name", "n1", "--gpu", "L40S", "--model", "Llama-3-8B", "--nvl-domain", "d1"])
    assert "--nvl-domain needs GPUs with NVLink: the L40S connects over PCIe only" in capsys.readouterr().err
