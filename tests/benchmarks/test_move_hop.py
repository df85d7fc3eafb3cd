"""The move-hop measurement the simulator's MOVE_HOP_S and stream_break_s come from."""

import asyncio
import random

from benchmarks import move_hop


def test_the_fit_recovers_a_hop_that_grows_with_the_moves_made_at_once():
    rows = [
        {"at_once": n, "order": i, "hop_ms": 6.0 + 0.75 * n, "noticed_ms": 8.0} for n in (1, 2, 4, 8) for i in range(n)
    ]
    fit = move_hop.fit(rows)
    assert fit["hop_ms_by_at_once"] == {"intercept_ms": 6.0, "ms_per_move": 0.75, "residual_sd_ms": 0.0}
    assert fit["hop_ms_by_order"]["residual_sd_ms"] > 0  # the wrong shape leaves a residual
    assert fit["noticed_ms_mean"] == 8.0 and fit["moves"] == 15


def test_a_real_round_times_every_move_off_the_killed_node():
    """Two emulated nodes, a gateway, four streams, the busier node SIGKILLed: each of its streams is restored on
    the other, and its break and hop are read from the gateway's signals."""
    round_ = asyncio.run(move_hop.one_round(2, random.Random(1)))
    assert not round_["errors"]
    moves = round_["moves"]
    assert len(moves) == round_["in_flight_on_it"] >= 2
    assert [m["order"] for m in moves] == list(range(len(moves)))
    for m in moves:
        assert m["method"] == "checkpoint-local" and m["restore_ms"] > 0
        assert 0 < m["noticed_ms"] < 1000 and 0 < m["hop_ms"] < 1000
