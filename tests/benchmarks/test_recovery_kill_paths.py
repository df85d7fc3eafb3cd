"""benchmarks.recovery_kill, short: every recovery path is taken under streaming load, by the gateway's own record of
each move, with no token lost or repeated on any; and the classification reads that record, not the event's intent."""

import asyncio

import pytest

from benchmarks import recovery_kill as rk
from benchmarks.harness import Result

# Six nodes in two racks, 12 streams of short answers (so the `none` phase turns over in seconds), every event once
# and each again up to three times where its path was not taken.
SHORT = rk.Scenario(
    nodes=6,
    streams=12,
    rounds=1,
    cold=1,
    reprefill_kills=1,
    retries=3,
    gap_s=3.0,
    steady_s=4.0,
    turnover_s=4.0,
    cold_wait_s=30.0,
    prompt_words=(200, 500),
    max_tokens=(60, 90, 120),
)


def move(**fields) -> dict:
    base = {
        "request_id": "b-1",
        "from": "n01",
        "to": "n02",
        "at_token": 10,
        "kind": "failure",
        "planned_method": "restore",
        "method": "checkpoint-local",
        "reason": "holder n02 not overloaded (L̂ 3.0 <= θ 8.0); restore 480 tokens from its host memory",
        "resume_reason": None,
        "tried": [],
        "at": 100.0,
    }
    return {**base, **fields}


def test_a_move_is_classified_by_the_method_the_gateway_recorded():
    assert rk.method_path(move()) == "local_restore"
    assert rk.method_path(move(method="checkpoint-fetched", planned_method="fetch")) == "fetch"
    # The plan said restore; the holder had no usable pages and re-prefilled: re-prefill, as it happened.
    assert rk.method_path(move(method="re-prefill")) == "reprefill"
    transfer = move(kind="planned", reason="planned migration (transfer)")
    assert rk.method_path(transfer) == "kv_transfer"
    # A planned re-prefill onto a node that happened to hold the request's checkpoint restored it locally.
    assert rk.method_path(move(kind="planned", reason="planned migration (reprefill)")) == "local_restore"
    assert rk.method_path(move(method=None, planned_method="fetch")) == "fetch"  # no report: the plan


def test_node_and_holder_needs_the_record_to_show_the_holder_went_down_with_it():
    pair = rk.Event("pair", ["n01", "n05"], 99.0, holders={"b-1": ["n05"], "b-2": ["n03"]})
    cold = rk.Event("cold", ["n01"], 99.0)
    # Its in-flight record named the other killed node as its holder.
    assert rk.paths_of(move(method="re-prefill"), pair) == ["reprefill", "node_and_holder"]
    # Another request of the same node, its holder alive: a plain restore, whatever the event meant.
    assert rk.paths_of(move(request_id="b-2", to="n03"), pair) == ["local_restore"]
    # The plan saw the holder failed (a request the in-flight record had not listed yet).
    failed_too = move(request_id="b-9", method="re-prefill", reason="holder n05 failed too; re-prefill 500 tokens")
    assert rk.paths_of(failed_too, pair) == ["reprefill", "node_and_holder"]
    unreachable = move(request_id="b-9", method="re-prefill", resume_reason="n05 unreachable (ClientConnectorError)")
    assert rk.paths_of(unreachable, pair) == ["reprefill", "node_and_holder"]
    assert rk.paths_of(move(), cold) == ["local_restore", "cold_restart"]
    assert rk.event_of(move(at=98.0), [pair]) is None  # before the event: not its doing


def test_each_move_the_client_saw_gets_its_own_stall():
    result = Result("b-1", 0.0, 100)
    result.moves = [
        ": lifeline moved this stream from n01 to n02 at token 0 (re-prefill; no checkpoint; re-prefill 100 tokens)",
        ": lifeline moved this stream from n02 to n03 at token 12 (checkpoint-local; planned migration (transfer))",
    ]
    result.stalls_ms = [41.5]  # the move before the first token had no token before it
    told = rk.client_moves(result)
    assert [(m["from"], m["at_token"], m["method"], m["stall_ms"]) for m in told] == [
        ("n01", 0, "re-prefill", None),
        ("n02", 12, "checkpoint-local", 41.5),
    ]
    assert told[1]["reason"] == "planned migration (transfer)"


@pytest.mark.e2e
def test_every_recovery_path_is_taken_under_load_with_no_token_lost_or_repeated():
    measured = asyncio.run(rk.run(SHORT))["measured"]

    assert measured["not_provoked"] == {}, measured["events"]
    for path in rk.PATHS:
        figures = measured["paths"][path]
        assert figures["stall_ms"]["n"] >= 1, (path, figures, measured["events"])
        lost = (figures["tokens_lost"], figures["tokens_repeated_or_wrong"], figures["requests_with_errors"])
        assert lost == (0, 0, 0), (path, figures)
    assert (measured["tokens_lost"], measured["tokens_repeated_or_wrong"]) == (0, 0)
    assert measured["requests_with_errors"] == 0, measured["errors"]
    assert measured["paths"]["kv_transfer"]["by_event"].get("drain")
    (cold,) = measured["cold_restarts"]
    assert "draft_ready" in cold["states"] and cold["serving_s"] is not None, cold  # loaded, not warm; back
