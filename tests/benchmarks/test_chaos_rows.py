"""benchmarks.chaos's judging of silent corruption: the sdc is judged by its drain, except where a later fault took
the corrupt node down before any drain of it could be raised (a node that is down cannot be drained); and the soak
leaves a corrupt node whose drain is not raised yet alone while another can be broken. Against a database of its own
on the run's PostgreSQL with the few columns the soak reads, as the stack's database would hold them, read through
psql as the soak reads it."""

import json
import os
import time

import psycopg
import pytest

from benchmarks.chaos import Fault, Soak, with_database
from console import env
from harness import databases

SCHEMA = """
CREATE TABLE recovery_node (id INTEGER PRIMARY KEY, name TEXT);
CREATE TABLE recovery_nodetransition (id SERIAL PRIMARY KEY, node_id INT, new_state TEXT, at TIMESTAMPTZ, cause TEXT);
CREATE TABLE recovery_healthtransition (id SERIAL PRIMARY KEY, node_id INT, new TEXT, at TIMESTAMPTZ);
CREATE TABLE recovery_incidentevent (id SERIAL PRIMARY KEY, node_id INT, at TIMESTAMPTZ);
CREATE TABLE recovery_drain (id SERIAL PRIMARY KEY, node_id INT);
CREATE TABLE recovery_drainstep (id SERIAL PRIMARY KEY, drain_id INT, at TIMESTAMPTZ);
CREATE TABLE recovery_auditentry (id SERIAL PRIMARY KEY, actor TEXT, reason TEXT);
"""


@pytest.fixture
def scratch():
    with databases.scratch("lifeline_chaos_rows") as url:
        yield url


def _connect(url: str):
    params = env.database_from_url(url)
    return psycopg.connect(
        host=params["HOST"], port=params["PORT"], user=params["USER"] or None, dbname=params["NAME"], autocommit=True
    )


def soak_on(url, faults):
    """A Soak that reads this database, never started (no stack)."""
    soak = Soak.__new__(Soak)
    soak.pg_db = env.database_from_url(url)["NAME"]
    soak.pg_admin = with_database(url, "postgres")
    soak.faults, soak.violations = faults, []
    soak.approvals = soak.second_approvals = 0
    with _connect(url) as db:
        db.execute(SCHEMA)
        for i in range(1, 6):
            db.execute("INSERT INTO recovery_node VALUES (%s, %s)", (i, f"node-0{i}"))
    return soak


def insert(soak, table, *values):
    marks = ", ".join(["%s"] * len(values))
    with _connect(with_database(soak.pg_admin, soak.pg_db)) as db:
        db.execute(f"INSERT INTO {table} VALUES (DEFAULT, {marks})", values)


def at(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S+00", time.gmtime(epoch))


T = 1_800_000_000.0  # the soak's faults, in epoch seconds


def test_an_sdc_whose_node_a_later_fault_killed_before_its_drain_is_counted_not_a_violation(scratch):
    sdc = Fault("sdc", 60, ["node-03"], injected_wall=T, note="drift")
    rack = Fault("rack", 80, ["node-03", "node-04"], injected_wall=T + 22, note="rack-b")
    soak = soak_on(scratch, [sdc, rack])
    insert(soak, "recovery_healthtransition", 3, "suspicious", at(T + 5))
    for node in (3, 4):
        insert(soak, "recovery_nodetransition", node, "down", at(T + 23), "rack lost")
        insert(soak, "recovery_incidentevent", node, at(T + 23))
    rows = soak.check_rows()
    assert soak.violations == []
    assert rows["sdc targets killed by a later fault before their drain"] == 1
    assert rows["node transitions"] == 2  # the rack's DOWN rows are still required, node-03's among them


def test_an_sdc_with_no_drain_and_no_later_fault_on_its_node_is_a_violation(scratch):
    sdc = Fault("sdc", 60, ["node-03"], injected_wall=T, note="drift")
    kill = Fault("node_kill", 80, ["node-04"], injected_wall=T + 22)  # another node: no excuse for node-03
    soak = soak_on(scratch, [sdc, kill])
    insert(soak, "recovery_healthtransition", 3, "unhealthy", at(T + 9))
    insert(soak, "recovery_incidentevent", 3, at(T + 9))
    insert(soak, "recovery_nodetransition", 4, "down", at(T + 23), "killed")
    insert(soak, "recovery_incidentevent", 4, at(T + 23))
    soak.check_rows()
    assert soak.violations == ["no drain step row for node-03 after sdc"]


def test_an_sdc_drained_before_a_later_kill_is_judged_by_its_drain(scratch):
    sdc = Fault("sdc", 60, ["node-03"], injected_wall=T, note="drift")
    kill = Fault("node_kill", 80, ["node-03"], injected_wall=T + 22)
    soak = soak_on(scratch, [sdc, kill])
    insert(soak, "recovery_healthtransition", 3, "unhealthy", at(T + 9))
    insert(soak, "recovery_incidentevent", 3, at(T + 9))
    insert(soak, "recovery_drain", 3)
    insert(soak, "recovery_drainstep", 1, at(T + 10))
    insert(soak, "recovery_nodetransition", 3, "down", at(T + 23), "killed")
    insert(soak, "recovery_incidentevent", 3, at(T + 23))
    rows = soak.check_rows()
    assert soak.violations == []
    assert rows["drain steps"] == 1 and "sdc targets killed by a later fault before their drain" not in rows


def test_a_hang_a_control_plane_fault_overlapped_is_judged_by_its_incident_event_and_counted(scratch):
    """Heartbeats are not judged while the control plane cannot hear them, so a hang covered by a Redis pause and a
    database restart (a run on 2026-12-07) may end before any DOWN: its incident event is still required."""
    pause = Fault("redis_pause", 44, injected_wall=T - 4, targets=["redis"])
    hang = Fault("node_hang", 48, ["node-04"], injected_wall=T, note="hung 12 s")
    restart = Fault("db_restart", 56, injected_wall=T + 6, targets=["postgres"])
    soak = soak_on(scratch, [pause, hang, restart])
    insert(soak, "recovery_incidentevent", 4, at(T + 5))
    rows = soak.check_rows()
    assert soak.violations == []
    assert rows["hangs a control-plane fault overlapped (judged by their incident event)"] == 1
    soak.violations = []
    with _connect(scratch) as db:
        db.execute("DELETE FROM recovery_incidentevent")
    soak.check_rows()
    assert soak.violations == ["no incident event row for node-04 after node_hang"]


def test_a_hang_with_no_control_plane_fault_near_it_must_be_marked_down(scratch):
    gateway = Fault("gateway_kill", 44, injected_wall=T - 4, targets=["gateway-2"])  # blinds no heartbeat
    hang = Fault("node_hang", 48, ["node-04"], injected_wall=T, note="hung 12 s")
    later = Fault("db_restart", 70, injected_wall=T + 14, targets=["postgres"])  # after its hang ended
    soak = soak_on(scratch, [gateway, hang, later])
    insert(soak, "recovery_incidentevent", 4, at(T + 5))
    soak.check_rows()
    assert soak.violations == ["no node transition row for node-04 after node_hang"]


def test_a_down_before_any_fault_touched_its_node_is_a_violation_though_a_later_fault_picks_that_node(scratch):
    """The run at 7671ff6: after a web restart and an empty Redis, five healthy nodes were marked DOWN; four of them
    were targets of faults injected later, and the soak excused those four."""
    web = Fault("web_restart", 8, injected_wall=T - 8, targets=["web"])
    redis_restart = Fault("redis_restart", 11, injected_wall=T - 6, targets=["redis"])
    kill = Fault("node_kill", 52, ["node-04"], injected_wall=T + 35)
    soak = soak_on(scratch, [web, redis_restart, kill])
    for node in (3, 4):  # both marked DOWN before any fault touched them
        insert(soak, "recovery_nodetransition", node, "down", at(T), "no heartbeat for 4.3 s")
    insert(soak, "recovery_nodetransition", 4, "down", at(T + 36), "killed")  # the kill's own DOWN
    insert(soak, "recovery_incidentevent", 4, at(T + 36))
    rows = soak.check_rows()
    assert rows["DOWN transitions of nodes no fault touched"] == 2
    [said] = soak.violations
    assert said.startswith("2 DOWN transitions of nodes no fault touched: node-03 at") and "node-04 at" in said


def test_a_corrupt_node_is_spared_by_later_faults_until_its_drain_is_raised(scratch):
    sdc = Fault("sdc", 60, ["node-03"], injected_wall=T, note="drift")
    soak = soak_on(scratch, [sdc])
    assert soak.undrained_corrupt() == {"node-03"}
    insert(soak, "recovery_drain", 3)
    insert(soak, "recovery_drainstep", 1, at(T + 10))
    assert soak.undrained_corrupt() == set()


def test_a_node_fault_goes_to_a_listed_node_that_takes_it_when_the_first_choice_is_already_down():
    """The console lists a node another fault killed seconds ago as serving until it notices: a node fault (here
    nvlink_down, as a run on 2026-12-06 drew) is injected on a node that takes it, and only when none does is the
    fault reported not injected, naming each refusal."""
    import random

    soak = Soak.__new__(Soak)  # only the fault injection: no stack
    soak.rng = random.Random(11)
    asked = []

    def agent_fault(name, kind, **params):
        asked.append(name)
        if name in down:
            raise ConnectionRefusedError(111, "Connection refused")

    soak.agent_fault = agent_fault
    down = {"node-04", "node-05"}
    chosen = soak.agent_fault_on_one(["node-04", "node-05", "node-06"], "nvlink_down")
    assert chosen == "node-06" and asked[-1] == "node-06" and set(asked) <= {"node-04", "node-05", "node-06"}
    down = {"node-04", "node-05", "node-06"}
    with pytest.raises(RuntimeError, match="no node took the nvlink_down fault: .*node-04.*Connection refused"):
        soak.agent_fault_on_one(["node-04", "node-05", "node-06"], "nvlink_down")


def test_node_and_holder_never_takes_a_pair_with_the_corrupt_node_in_it(redis_keys):
    """Every pair in flight has the undrained corrupt node in it (it serves several streams, or holds their
    checkpoints): the fault takes two other serving nodes, not the corrupt one, so its sdc is still judged by its
    drain (a loaded run on 2026-12-07 lost the sdc's drain rows to such a pair)."""
    client, keys = redis_keys
    soak = Soak.__new__(Soak)  # only the choice of victims: no stack
    soak.redis_url, soak.namespace = os.environ["REDIS_URL"], keys.namespace
    soak.serving_nodes = lambda: ["node-01", "node-02", "node-03", "node-04"]
    flights = {"r1": {"node": "node-02", "holders": ["node-01"]}, "r2": {"node": "node-03", "holders": ["node-02"]}}
    for request, flight in flights.items():
        client.hset(keys.gateway_inflight("gateway-1"), request, json.dumps(flight))
    assert soak.holder_pair({"node-02"}) == ["node-01", "node-03"]
    assert soak.holder_pair(set()) in (["node-02", "node-01"], ["node-03", "node-02"])  # a pair in flight
    client.hset(keys.gateway_inflight("gateway-2"), "r3", json.dumps({"node": "node-04", "holders": ["node-03"]}))
    assert soak.holder_pair({"node-02"}) == ["node-04", "node-03"]
