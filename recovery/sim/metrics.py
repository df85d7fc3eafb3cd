"""What a run measured: each request's latencies and recovery, the run's summary, and recovery time.

Recovery time follows source document 000: the time from failure detection until the cluster's latency is back
within 10 % of its no-failure baseline (the failure-impact window is the same, counted from the fault itself).
The baseline is the same scenario, seed and policy run without faults: the same requests at the same times, so
before the fault the two runs are identical, and any difference after it is the fault's doing.

Latency is compared in windows of `window_s` seconds of simulated time, each sample placed where a client sees
it: a request's TTFT at its first token, each inter-token gap (TPOT) at the later token, so a stalled stream
shows up when it resumes. A window is within the bound when its mean TTFT and its mean gap are both at most
1.1 × the baseline's same window (a window with no samples in either run is within). The cluster has recovered
at the start of the first window after which every window up to the next fault (or the end of the arrivals) is
within; a run that never gets there has no recovery time (None).

Degradation (a scenario with a throughput objective): the requests refused, by tier and by (model, tier, level,
HTTP code), each model's time at each level and its level changes in order (the timeline a chart steps through);
each request's tier, the level it finished at and the latency-objective factor that level gives it (×2 from level
3). A shed request has no latency: it is counted in `requests` and `shed`, never in `finished` or the latencies.

Silent corruption: each sdc fault's detection delay (fault to weight 0), when its first failed canary halved the
node's weight, and how many requests the real system would name as possibly corrupt (served by the node since its
last good canary); live migrations that moved KV are counted in `transferred`.

Draft assist: each pairing of a restarting node's draft model with a survivor, and the steps it assisted, the tokens
it drafted and the survivor tested and accepted. These are MODELLED: the simulator draws each drafted token's
acceptance at the model pair's draft agreement α (an input from workers.catalog), so the acceptance they give is
the draws', not a measurement of any draft model.
"""

import math
from collections import Counter
from dataclasses import asdict, dataclass, field

from recovery.policy.capacity import EFFECTS
from recovery.sim.fleet import SERIES_S, Flight, Simulation

TOLERANCE = 0.10  # document 000: "within 10 % of its no-failure baseline"
WINDOW_S = 5.0
SMOOTH = 3  # windows a recovery is judged over: a single window's noise does not decide it


@dataclass(frozen=True)
class RequestMetrics:
    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    emitted: int  # tokens the client got
    ttft_s: float | None
    tpot_s: float | None  # mean time per output token after the first
    e2e_s: float | None  # arrival to last token; None when unfinished
    interrupted: bool
    stall_s: float | None  # the longest: from a fault that cut it off to its next token
    recovered_by: str | None  # "restore", "fetch", "transfer" or "reprefill" (the last); None if never interrupted
    restored_tokens: int
    tier: str = "standard"
    shed_code: int | None = None  # 429 or 503 when its model's degradation level refused it
    level: int = 0  # its model's degradation level when it finished (or was refused)
    latency_slo_factor: float = 1.0  # what that level multiplies its latency objectives by
    possibly_corrupt: bool = False  # served by a node found corrupt, since that node's last good canary


def request_metrics(flight: Flight) -> RequestMetrics:
    first, last, emitted = flight.first_token_s, flight.last_token_s, flight.emitted
    finished = flight.finished_at is not None
    level = flight.shed[1] if flight.shed else flight.level
    return RequestMetrics(
        request_id=flight.request_id,
        arrival_s=flight.request.arrival_s,
        prompt_tokens=flight.request.prompt_tokens,
        output_tokens=flight.request.output_tokens,
        emitted=emitted,
        ttft_s=None if first is None else first - flight.request.arrival_s,
        tpot_s=(last - first) / (emitted - 1) if emitted > 1 and first is not None and last is not None else None,
        e2e_s=last - flight.request.arrival_s if finished and last is not None else None,
        interrupted=bool(flight.interrupted_at),
        stall_s=max(flight.stalls) if flight.stalls else None,
        recovered_by=flight.methods[-1] if flight.methods else None,
        restored_tokens=flight.restored_tokens[-1] if flight.restored_tokens else 0,
        tier=flight.request.tier,
        shed_code=flight.shed[0] if flight.shed else None,
        level=level,
        latency_slo_factor=EFFECTS[level].latency_slo_factor,
        possibly_corrupt=flight.possibly_corrupt,
    )


def percentile(values: list[float], p: float) -> float | None:
    """The p-th percentile (0–100), linear between closest ranks; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


@dataclass(frozen=True)
class FaultRecovery:
    at_s: float
    kind: str
    target: str
    nodes: tuple[str, ...]
    detected_s: float
    interrupted: int
    by_method: dict
    recovered_at_s: float | None
    recovery_s: float | None  # from detection (document 000's recovery time)
    impact_window_s: float | None  # from the fault
    detection_s: float | None = None  # from the fault to out of routing (sdc: to weight 0 at the last canary)
    suspicious_s: float | None = None  # sdc: when the first failed canary halved its weight
    possibly_corrupt: int = 0  # sdc: requests served by the node since its last good canary


@dataclass(frozen=True)
class RunMetrics:
    policy: str
    seed: int
    requests: int
    finished: int
    interrupted: int
    restored: int
    fetched: int
    reprefilled: int
    ttft_mean_s: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_mean_s: float | None
    tpot_p50_s: float | None
    tpot_p99_s: float | None
    e2e_mean_s: float | None
    stall_mean_s: float | None
    stall_max_s: float | None
    faults: tuple[FaultRecovery, ...]
    skipped_faults: int  # of kinds the simulator does not model (fleet.UNMODELLED_KINDS: none since sdc is)
    simulated_s: float
    events: int
    transferred: int = 0  # requests moved live with their KV (off a node found corrupt)
    possibly_corrupt: int = 0
    shed: int = 0  # requests refused by a degradation level (429 or 503)
    shed_by_tier: dict = field(default_factory=dict)  # tier -> requests refused
    shed_detail: list = field(default_factory=list)  # {model, tier, level, code, requests}
    seconds_at_level: dict = field(default_factory=dict)  # model -> {level: seconds}, over the whole run
    level_changes: list = field(default_factory=list)  # each LevelChange as a dict, in time order
    assist: dict = field(default_factory=dict)  # draft assist's figures (assist_figures): modelled

    def to_json(self) -> dict:
        return asdict(self)


def check_window(window_s: float) -> None:
    """Windows are whole numbers of the simulator's SERIES_S buckets; anything else is refused, saying so."""
    buckets = window_s / SERIES_S
    if not window_s > 0 or abs(buckets - round(buckets)) > 1e-9:
        raise ValueError(f"the window must be a positive multiple of {SERIES_S:g} s, got {window_s:g}")


def windows(series: dict[int, list], window_s: float = WINDOW_S) -> dict[int, float]:
    """A simulation's latency series (Simulation.ttft_series or gap_series) as the mean in each window of
    `window_s` seconds, by window number (window w covers [w·window_s, (w+1)·window_s))."""
    check_window(window_s)
    per = round(window_s / SERIES_S)
    sums: dict[int, list[float]] = {}
    for bucket, (total, count) in series.items():
        entry = sums.setdefault(bucket // per, [0.0, 0])
        entry[0] += total
        entry[1] += count
    return {w: total / count for w, (total, count) in sums.items()}


def recovered_at(
    faulted: Simulation, baseline: Simulation, start_s: float, end_s: float, window_s: float = WINDOW_S
) -> float | None:
    """The start of the first window from `start_s` after which every window before `end_s` is within 10 % of the
    baseline; None when the last one is not. Each window is judged by the mean of the SMOOTH windows around it (those
    from it on, the last SMOOTH at the end): one noisy window, at the end above all, crossed the 10 % line alone and
    said "not back" of a run whose chart showed it back (issue 43)."""
    faulted_ttft, faulted_gaps = windows(faulted.ttft_series, window_s), windows(faulted.gap_series, window_s)
    base_ttft, base_gaps = windows(baseline.ttft_series, window_s), windows(baseline.gap_series, window_s)

    first, last = int(start_s // window_s), max(int(math.ceil(end_s / window_s)) - 1, int(start_s // window_s))

    def within(w: int) -> bool:
        begin = max(first, min(w, last - SMOOTH + 1))
        span = range(begin, min(begin + SMOOTH, last + 1))
        for mine, base in ((faulted_ttft, base_ttft), (faulted_gaps, base_gaps)):
            if any(i in mine and i not in base for i in span):
                return False  # the fault's doing: latency the baseline had none of by then
            ours, theirs = [mine[i] for i in span if i in mine], [base[i] for i in span if i in mine]
            if ours and sum(ours) > (1 + TOLERANCE) * sum(theirs):
                return False
        return True

    recovered = None
    for w in range(last, first - 1, -1):
        if not within(w):
            break
        recovered = w
    if recovered is None:
        return None
    return max(start_s, recovered * window_s)


ASSIST_KIND = (
    "modelled: outcomes of the simulator's draws, each drafted token accepted with probability α, the model pair's "
    "draft agreement (an input from workers.catalog, not measured)"
)


def assist_figures(sim: Simulation) -> dict:
    """Draft assist over the run: its pairings and, summed over them, the steps assisted and the tokens drafted,
    tested (the drafts up to the first rejected one) and accepted; every figure an outcome of draws at α."""
    total: Counter = Counter()
    for pairing in sim.assists:
        total.update(pairing.counters)
    tested, accepted = total["draft_tested"], total["draft_accepted"]
    return {
        "kind": ASSIST_KIND,
        "pairings": len(sim.assists),
        "assisted_steps": total["assist_steps"],
        "drafted_tokens": total["draft_proposed"],
        "tested_tokens": tested,
        "accepted_tokens": accepted,
        "assisted_tokens": total["assisted_tokens"],  # emitted on assisted sequence steps: accepted plus one each
        "acceptance": accepted / tested if tested else None,
        "by_pairing": [
            {
                "draft": p.draft,
                "survivor": p.survivor,
                "started_s": p.started_s,
                "ended_s": p.ended_s,
                "agreement": {"value": p.agreement, "kind": "input (workers.catalog draft agreement)"},
                **{key: p.counters[key] for key in ("assist_steps", "draft_proposed", "draft_accepted")},
            }
            for p in sim.assists
        ],
    }


def run_metrics(sim: Simulation, baseline: Simulation | None = None, window_s: float = WINDOW_S) -> RunMetrics:
    per_request = [request_metrics(f) for f in sim.flights]
    ttft = [r.ttft_s for r in per_request if r.ttft_s is not None]
    tpot = [r.tpot_s for r in per_request if r.tpot_s is not None]
    stalls = [r.stall_s for r in per_request if r.stall_s is not None]
    methods = [m for f in sim.flights for m in f.methods]
    records = sorted(sim.fault_records, key=lambda r: r.fault.at_s)
    horizon = sim.scenario.duration_s
    faults = []
    for i, record in enumerate(records):
        back = None
        if baseline is not None and record.nodes:
            end = records[i + 1].fault.at_s if i + 1 < len(records) else horizon
            back = recovered_at(sim, baseline, record.fault.at_s, end, window_s)
        faults.append(
            FaultRecovery(
                at_s=record.fault.at_s,
                kind=record.fault.kind,
                target=record.fault.target,
                nodes=record.nodes,
                detected_s=record.detected_s,
                interrupted=record.interrupted,
                by_method=dict(sorted(record.by_method.items())),
                recovered_at_s=back,
                recovery_s=None if back is None else max(0.0, back - record.detected_s),
                impact_window_s=None if back is None else back - record.fault.at_s,
                detection_s=record.detected_s - record.fault.at_s if record.nodes else None,
                suspicious_s=record.suspicious_s,
                possibly_corrupt=len(record.possibly_corrupt),
            )
        )
    return RunMetrics(
        policy=sim.policy,
        seed=sim.seed,
        requests=len(per_request),
        finished=sum(1 for f in sim.flights if f.finished_at is not None),
        interrupted=sum(1 for r in per_request if r.interrupted),
        restored=methods.count("restore"),
        fetched=methods.count("fetch"),
        reprefilled=methods.count("reprefill"),
        ttft_mean_s=_mean(ttft),
        ttft_p50_s=percentile(ttft, 50),
        ttft_p99_s=percentile(ttft, 99),
        tpot_mean_s=_mean(tpot),
        tpot_p50_s=percentile(tpot, 50),
        tpot_p99_s=percentile(tpot, 99),
        e2e_mean_s=_mean([r.e2e_s for r in per_request if r.e2e_s is not None]),
        stall_mean_s=_mean(stalls),
        stall_max_s=max(stalls) if stalls else None,
        faults=tuple(faults),
        skipped_faults=len(sim.skipped_faults),
        simulated_s=sim.now,
        events=sim.events_processed,
        transferred=methods.count("transfer"),
        possibly_corrupt=sum(1 for f in sim.flights if f.possibly_corrupt),
        shed=sum(1 for f in sim.flights if f.shed),
        shed_by_tier=sim.degradation.shed_by_tier() if sim.degradation.enabled else {},
        shed_detail=sim.degradation.shed_rows(),
        seconds_at_level=sim.degradation.seconds_at_levels(sim.now),
        level_changes=[asdict(c) for c in sim.degradation.changes],
        assist=assist_figures(sim),
    )
