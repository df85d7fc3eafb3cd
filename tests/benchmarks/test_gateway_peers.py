"""benchmarks.gateway_peers, short: the side-by-side benchmark runs end to end on its own paths (no peer installed),
two gateway processes share one port, and what it reports is what it measured."""

import argparse
import asyncio

import pytest

from benchmarks import gateway_peers as gp


@pytest.mark.e2e
def test_direct_and_two_gateway_processes_on_one_port_are_measured_side_by_side():
    args = argparse.Namespace(
        nodes=2,
        model="Qwen3-32B",
        time_scale=0.05,
        rates="8",
        seconds=2.0,
        max_tokens=16,
        policy="lifeline",
        paths="direct,lifeline-x2",
        aiperf_rate=0,
    )
    results = asyncio.run(gp.run(args))

    assert results["skipped"] == {}
    direct, shared = results["paths"]["direct"], results["paths"]["lifeline-x2"]
    for path in (direct, shared):
        (row,) = path["rates"]
        assert row["requests"] >= 8 and row["errors"] == 0, row
        assert row["tokens"] >= row["requests"], row  # every stream gave tokens
    (row,) = shared["rates"]
    # Both processes were started on the port (start_gateway waits for each by its own name) and their CPU is summed.
    each = row["router_cpu_s_per_process"]
    assert len(each) == 2 and row["router_cpu_s"] == pytest.approx(sum(each), abs=0.002), row
    assert row["cpu_ms_per_1000_tokens"] == pytest.approx(1e6 * row["router_cpu_s"] / row["tokens"], rel=0.01)
    # What the path adds is its own percentile less direct's at the same rate.
    (added,) = shared["added"]
    assert added["added_ttft_p50_ms"] == pytest.approx(
        row["ttft_ms"]["p50"] - direct["rates"][0]["ttft_ms"]["p50"], abs=0.01
    )
    assert results["ratios_lifeline_over_peer"] == {}  # no peer ran, and the one-process path was not asked for
