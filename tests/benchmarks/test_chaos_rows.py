"""benchmarks.chaos's judging of silent corruption: the sdc is judged by its drain, except where a later fault took
the corrupt node down before any drain of it could be raised (a node that is down cannot be drained); and the soak
leaves a corrupt node whose drain is not raised yet alone while another can be broken. Against a SQLite file with
the few columns the soak reads, as the stack's database would hold them."""

import sqlite3
import time

from benchmarks.chaos import Fault, Soak

SCHEMA = """
CREATE TABLE recovery_node (id INTEGER PRIMARY KEY, name TEXT);
CREATE TABLE recovery_nodetransition (id INTEGER PRIMARY KEY, node_id INT, new_state TEXT, at TEXT, cause TEXT);
CREATE TABLE recovery_healthtransition (id INTEGER PRIMARY KEY, node_id INT, new TEXT, at TEXT);
CREATE TABLE recovery_incidentevent (id INTEGER PRIMARY KEY, node_id INT, at TEXT);
CREATE TABLE recovery_drain (id INTEGER PRIMARY KEY, node_id INT);
CREATE TABLE recovery_drainstep (id INTEGER PRIMARY KEY, drain_id INT, at TEXT);
CREATE TABLE recovery_auditentry (id INTEGER PRIMARY KEY, actor TEXT, reason TEXT);
"""


def soak_on(tmp_path, faults):
    """A Soak that reads this SQLite file, never started (no stack, no PostgreSQL)."""
    soak = Soak.__new__(Soak)
    soak.var_dir, soak.pg_db, soak.faults, soak.violations = tmp_path, None, faults, []
    soak.approvals = soak.second_approvals = 0
    with sqlite3.connect(tmp_path / "lifeline.sqlite3") as db:
        db.executescript(SCHEMA)
        db.executemany("INSERT INTO recovery_node VALUES (?, ?)", [(i, f"node-0{i}") for i in range(1, 6)])
    return soak


def insert(soak, table, *values):
    marks = ", ".join("?" * len(values))
    with sqlite3.connect(soak.var_dir / "lifeline.sqlite3") as db:
        db.execute(f"INSERT INTO {table} VALUES (NULL, {marks})", values)


def at(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(epoch))


T = 1_800_000_000.0  # the soak's faults, in epoch seconds


def test_an_sdc_whose_node_a_later_fault_killed_before_its_drain_is_counted_not_a_violation(tmp_path):
    sdc = Fault("sdc", 60, ["node-03"], injected_wall=T, note="drift")
    rack = Fault("rack", 80, ["node-03", "node-04"], injected_wall=T + 22, note="rack-b")
    soak = soak_on(tmp_path, [sdc, rack])
    insert(soak, "recovery_healthtransition", 3, "suspicious", at(T + 5))
    for node in (3, 4):
        insert(soak, "recovery_nodetransition", node, "down", at(T + 23), "rack lost")
        insert(soak, "recovery_incidentevent", node, at(T + 23))
    rows = soak.check_rows()
    assert soak.violations == []
    assert rows["sdc targets killed by a later fault before their drain"] == 1
    assert rows["node transitions"] == 2  # the rack's DOWN rows are still required, node-03's among them


def test_an_sdc_with_no_drain_and_no_later_fault_on_its_node_is_a_violation(tmp_path):
    sdc = Fault("sdc", 60, ["node-03"], injected_wall=T, note="drift")
    kill = Fault("node_kill", 80, ["node-04"], injected_wall=T + 22)  # another node: no excuse for node-03
    soak = soak_on(tmp_path, [sdc, kill])
    insert(soak, "recovery_healthtransition", 3, "unhealthy", at(T + 9))
    insert(soak, "recovery_incidentevent", 3, at(T + 9))
    insert(soak, "recovery_nodetransition", 4, "down", at(T + 23), "killed")
    insert(soak, "recovery_incidentevent", 4, at(T + 23))
    soak.check_rows()
    assert soak.violations == ["no drain step row for node-03 after sdc"]


def test_an_sdc_drained_before_a_later_kill_is_judged_by_its_drain(tmp_path):
    sdc = Fault("sdc", 60, ["node-03"], injected_wall=T, note="drift")
    kill = Fault("node_kill", 80, ["node-03"], injected_wall=T + 22)
    soak = soak_on(tmp_path, [sdc, kill])
    insert(soak, "recovery_healthtransition", 3, "unhealthy", at(T + 9))
    insert(soak, "recovery_incidentevent", 3, at(T + 9))
    insert(soak, "recovery_drain", 3)
    insert(soak, "recovery_drainstep", 1, at(T + 10))
    insert(soak, "recovery_nodetransition", 3, "down", at(T + 23), "killed")
    insert(soak, "recovery_incidentevent", 3, at(T + 23))
    rows = soak.check_rows()
    assert soak.violations == []
    assert rows["drain steps"] == 1 and "sdc targets killed by a later fault before their drain" not in rows


def test_a_corrupt_node_is_spared_by_later_faults_until_its_drain_is_raised(tmp_path):
    sdc = Fault("sdc", 60, ["node-03"], injected_wall=T, note="drift")
    soak = soak_on(tmp_path, [sdc])
    assert soak.undrained_corrupt() == {"node-03"}
    insert(soak, "recovery_drain", 3)
    insert(soak, "recovery_drainstep", 1, at(T + 10))
    assert soak.undrained_corrupt() == set()
