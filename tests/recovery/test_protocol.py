"""The protocol between the control plane and its gateways (recovery.protocol): routes, keys, the cluster's settings and
the gateways' signals are each written and read through one class, carry their version, and say what is wrong with an
entry that cannot be read; a signal of a kind the control plane does not know is an error, never dropped in silence,
and a stream taken over by another gateway (request_resumed) reaches the lost gateway's incident."""

import dataclasses
import json
import logging
import re
import time
from pathlib import Path

import pytest

from recovery import hot, protocol
from recovery.actions import conditions, keys, routing, streams
from recovery.choices import EventKind, FailureClass
from recovery.models import Cluster, ModelCapacity
from recovery.protocol import ClusterConfig, ModelLevel, ProtocolError, Route, Tenant, Trust, UnknownSignal
from tests.recovery.test_trusted_providers import serve

ROOT = Path(__file__).resolve().parents[2]

SIGNALS = [
    protocol.Symptom("n1", "stream broke", at=1.5, in_flight=3),
    protocol.RequestMoved("r1", "n1", "n2", at=2.0, tried=["n3"], at_token=40, method="re-prefill", stall_ms=80.5),
    protocol.RequestResumed("r1", "n2", 41, at=3.0, tenant="t"),
    protocol.HolderReplaced("r1", "n2", "n1", ["n4"], at=4.0, blocks_resent=12),
    protocol.NodeError("n1", 500, "engine crashed", "r2", at=5.0, served_by="n2"),
    protocol.MigrationCommandDone("c1", "n1", "gw-1", at=6.0, requests=3, transfer=2, failed=1),
    protocol.RequestFailed("r3", ["n1", "n2"], [500, 500], "bad input", at=7.0, content_key="abc"),
]


@pytest.mark.parametrize("signal", SIGNALS, ids=lambda s: s.KIND)
def test_every_signal_is_read_back_as_it_was_written(signal):
    wire = json.loads(json.dumps(signal.to_wire()))  # as it crosses Redis
    assert wire["v"] == protocol.VERSION
    assert protocol.read_signal(signal.KIND, wire) == signal
    assert set(protocol.SIGNALS) == {s.KIND for s in SIGNALS}  # each kind has its class, and is tested here


def test_routes_keys_and_settings_are_read_back_as_they_were_written():
    route = Route("n1", "http://n1", "Qwen3-32B", "rack-a", 0.5, "H200-SXM", 2, "s", frozenset({"resume"}), region="eu")
    assert Route.from_wire("n1", json.loads(json.dumps(route.to_wire()))) == route
    tenant = Tenant(7, "acme", "premium", Trust(frozenset({"ours"}), frozenset()))
    assert Tenant.from_wire(json.loads(json.dumps(tenant.to_wire()))) == tenant
    config = ClusterConfig(
        tau_tokens=256, models={"Qwen3-32B": ModelLevel(2, ("best_effort",), True)}, starting_until=9
    )
    assert ClusterConfig.from_wire(json.loads(json.dumps(config.to_wire()))) == config
    assert ClusterConfig.from_wire(None) == ClusterConfig()  # nothing written yet: the defaults


def test_an_entry_that_cannot_be_read_says_what_is_wrong_with_it():
    route = Route("n1", "http://n1", "Qwen3-32B", "rack-a", 1.0).to_wire()
    with pytest.raises(ProtocolError, match="route n1 has no 'address'"):
        Route.from_wire("n1", {k: v for k, v in route.items() if k != "address"})
    with pytest.raises(ProtocolError, match="route n1 is protocol version 2; this side reads up to 1: upgrade it"):
        Route.from_wire("n1", {**route, "v": 2})
    with pytest.raises(ProtocolError, match="route n1: .*No-Such-Model"):
        Route.from_wire("n1", {**route, "model": "No-Such-Model"})  # the catalog cannot time it
    assert Route.from_wire("n1", {**route, "added_later": 1}).name == "n1"  # a field it does not know: ignored
    with pytest.raises(ProtocolError, match="a request_moved signal has no 'to'"):
        protocol.read_signal("request_moved", {"request_id": "r", "from": "n1"})
    with pytest.raises(UnknownSignal, match="'node_on_fire'"):
        protocol.read_signal("node_on_fire", {})


def test_the_product_writes_and_reads_these_shapes_only_through_the_protocol_module():
    """The classes are defined once, and every signal is emitted as one (no `emit("kind", ...)` left)."""
    defined = {}
    for path in sorted((ROOT / "recovery").rglob("*.py")):
        text = path.read_text()
        for name in ("Route", "ClusterConfig", "Tenant", "Trust", "Signal"):
            if re.search(rf"^class {name}\b", text, re.MULTILINE):
                defined.setdefault(name, []).append(str(path.relative_to(ROOT)))
        assert not re.search(r"\.(emit|report)\(\s*\"", text), f"{path}: a signal emitted as a kind and keywords"
    assert defined == {name: ["recovery/protocol.py"] for name in defined} and len(defined) == 5


@pytest.mark.django_db
def test_the_control_planes_entries_are_the_protocols(commit):
    commit(serve, "p-1", region="eu")
    key, _ = commit(keys.create_api_key, "acme", "premium", regions="eu")
    ModelCapacity.objects.create(cluster=Cluster.default(), model_key="Qwen3-32B", degradation_level=2)
    routing.sync_hot_state()
    r, names = hot.client(), hot.keys()
    route = Route.from_wire("p-1", json.loads(r.hget(names.routing, "p-1")))
    assert (route.address, route.model, route.rack, route.region) == ("http://127.0.0.1:9", "Qwen3-32B", "rack-a", "eu")
    tenant = Tenant.from_wire(json.loads(r.hget(names.gateway_keys, key.digest)))
    assert (tenant.tenant, tenant.tier, tenant.trust) == ("acme", "premium", Trust(frozenset(), frozenset({"eu"})))
    config = ClusterConfig.from_wire(json.loads(r.get(names.cluster_config)))
    assert config.level_of("Qwen3-32B").level == 2 and config.level_of("Qwen3-32B").shed_tiers


@pytest.mark.django_db
def test_a_signal_of_an_unknown_kind_on_the_stream_is_logged_as_an_error_and_the_rest_handled(caplog):
    r, keys = hot.client(), hot.keys()
    r.xadd(keys.signals, {"kind": "node_on_fire", "gateway": "gw-9", "data": json.dumps({"node": "n1"})})
    r.xadd(keys.signals, {"kind": "symptom", "gateway": "gw-9", "data": json.dumps({"node": "ghost"})})  # no reason
    with caplog.at_level(logging.ERROR, logger="recovery.actions.streams"):
        assert streams.process()["signals"] == 2  # read and acknowledged: neither blocks the stream
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [type(r.exc_info[1]) for r in errors] == [UnknownSignal, ProtocolError]
    assert "node_on_fire" in str(errors[0].exc_info[1]) and "has no 'reason'" in str(errors[1].exc_info[1])


@pytest.mark.django_db
def test_a_stream_taken_over_after_its_gateway_was_lost_is_on_that_gateways_incident():
    lost = conditions.begin(
        FailureClass.GATEWAY_LOST, "gw-1", time.time() - 10, "gateway gw-1 silent", details={"requests": ["r-7"]}
    )
    streams.handle_signal("request_resumed", "gw-2", dataclasses.asdict(protocol.RequestResumed("r-7", "n3", 57)))
    event = lost.incident.events.get(kind=EventKind.REQUEST_RESUMED)
    assert event.request_id == "r-7" and event.source == "gateway gw-2"
    assert "taken over by gateway gw-2 from lost gateway gw-1: n3 kept it running and goes on from token 57" in (
        event.description
    )
    # One no lost gateway had in flight (a client reconnecting while its gateway lives): nothing on any timeline.
    streams.handle_signal("request_resumed", "gw-2", protocol.RequestResumed("r-8", "n3", 5).to_wire())
    assert not lost.incident.events.filter(kind=EventKind.REQUEST_RESUMED, request_id="r-8").exists()
