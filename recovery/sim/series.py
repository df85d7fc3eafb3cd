"""Latency over time: mean TTFT and mean inter-token gap (TPOT) per window of simulated time, for each run and for
each policy over its seeds, with the faults' times; what the console's experiment charts and CSV are drawn from.

Built from the simulation's own latency series (Simulation.ttft_series and gap_series: a sum and a count per
SERIES_S bucket, each sample placed where a client sees it, a TTFT at the first token, a gap at the later token),
so a stalled stream shows up in the window it resumes in. A window is a whole number of buckets
(recovery.sim.metrics.check_window). A window with no sample has no mean (None), never a zero that would read as
fast.
"""

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from recovery.sim.experiment import RunResult
from recovery.sim.fleet import SERIES_S, Simulation
from recovery.sim.metrics import check_window


@dataclass(frozen=True)
class Window:
    start_s: float
    ttft_mean_s: float | None
    ttft_samples: int
    tpot_mean_s: float | None
    tpot_samples: int


def _sums(series: Iterable[dict[int, list]], window_s: float) -> dict[int, tuple[float, int]]:
    """Window index -> (sum, count) of the buckets of every series given, pooled."""
    per = round(window_s / SERIES_S)
    sums: dict[int, tuple[float, int]] = {}
    for buckets in series:
        for bucket, (value, count) in buckets.items():
            total, n = sums.get(bucket // per, (0.0, 0))
            sums[bucket // per] = (total + value, n + count)
    return sums


def _windows(sims: Sequence[Simulation], window_s: float) -> list[Window]:
    """The windows of every simulation given, their samples pooled, from 0 to the last token."""
    check_window(window_s)
    ttft_sums = _sums((sim.ttft_series for sim in sims), window_s)
    gap_sums = _sums((sim.gap_series for sim in sims), window_s)
    last = max([*ttft_sums, *gap_sums], default=-1)
    rows = []
    for index in range(last + 1):
        ttft_total, ttft_count = ttft_sums.get(index, (0.0, 0))
        gap_total, gap_count = gap_sums.get(index, (0.0, 0))
        rows.append(
            Window(
                start_s=index * window_s,
                ttft_mean_s=ttft_total / ttft_count if ttft_count else None,
                ttft_samples=ttft_count,
                tpot_mean_s=gap_total / gap_count if gap_count else None,
                tpot_samples=gap_count,
            )
        )
    return rows


def run_windows(result: RunResult, window_s: float) -> list[Window]:
    """One run's windows (the faulted simulation), from 0 to the last token."""
    return _windows([result.simulation], window_s)


def by_policy(results: Sequence[RunResult], window_s: float) -> dict:
    """One line per policy, its seeds' samples pooled, on a shared time axis; and every fault once, in time order.

    ``{"window_s", "starts": [s…], "policies": [{"policy", "ttft_s": […], "tpot_s": […]}…], "faults": [{"at_s",
    "detected_s", "kind", "target"}…]}``, each list of means as long as ``starts``; the policies in the order run
    (a list, not an object: a JSON column need not keep an object's key order).
    """
    pooled: dict[str, list[Simulation]] = {}
    for result in results:
        pooled.setdefault(result.metrics.policy, []).append(result.simulation)
    lines = {policy: _windows(sims, window_s) for policy, sims in pooled.items()}
    length = max((len(rows) for rows in lines.values()), default=0)
    policies = []
    for policy, rows in lines.items():
        padded = rows + [None] * (length - len(rows))
        policies.append(
            {
                "policy": policy,
                "ttft_s": [row.ttft_mean_s if row else None for row in padded],
                "tpot_s": [row.tpot_mean_s if row else None for row in padded],
            }
        )
    faults = {
        (f.at_s, f.kind, f.target): {"at_s": f.at_s, "detected_s": f.detected_s, "kind": f.kind, "target": f.target}
        for result in results
        for f in result.metrics.faults
    }
    return {
        "window_s": window_s,
        "starts": [index * window_s for index in range(length)],
        "policies": policies,
        "faults": [faults[key] for key in sorted(faults)],
    }


def windows_json(result: RunResult, window_s: float) -> list[dict]:
    return [asdict(row) for row in run_windows(result, window_s)]
