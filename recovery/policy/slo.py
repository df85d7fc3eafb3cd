"""Service-level objectives as arithmetic: histogram bounds, per-minute rollups, attainment, error budgets, burn rates
and the multi-window multi-burn-rate alert state (Google SRE workbook, chapter 5).

Pure: no Django. The control plane rolls request outcomes into `MinuteRollup`s here (recovery.actions.slo) and the
console turns summed counts into the figures a manager reads (console.readmodels.slo); both call these functions.

Definitions, once:
- valid: a request that counts. A client's 4xx and a client that hung up are not ours to count; a server-side failure
  and a request shed by the degradation level (429 or 503) count against the tier it was owed to.
- availability good: valid and answered without a server-side failure (status ok).
- TTFT / TPOT good: the measurement is at or under the objective's threshold; only requests that have the
  measurement are valid for that objective (TPOT needs two tokens).
- joint good: answered (status ok) and within every latency objective of its tier; joint attainment is joint good
  over all valid requests, goodput is joint good per second (DistServe's definition).
- attainment = good / valid; error budget = 1 − target; burn rate = (1 − attainment) / (1 − target); budget
  remaining = 1 − bad / (valid × (1 − target)).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta

# Histogram bucket upper bounds in milliseconds (a value v lands in the first bucket whose bound is >= v, as
# Prometheus' `le`; one more bucket past the last holds the rest). An objective's threshold must be one of them, so
# its good count is exact from the histogram, and a percentile read from it is off by at most one bucket. They
# include every MLPerf Inference latency constraint the shipped defaults (_BY_SIZE below) use.
TTFT_BOUNDS_MS: tuple[int, ...] = (
    25, 50, 100, 150, 200, 250, 300, 400, 450, 500, 600, 750, 1000, 1500, 2000, 2500, 3000, 4000, 5000, 6000, 8000,
    10000, 15000, 20000, 30000, 60000,
)  # fmt: skip
TPOT_BOUNDS_MS: tuple[int, ...] = (
    5, 10, 15, 20, 25, 30, 35, 40, 50, 60, 70, 80, 90, 100, 125, 150, 175, 200, 250, 300, 400, 500, 750, 1000, 2000,
)  # fmt: skip
BOUNDS_MS = {"ttft": TTFT_BOUNDS_MS, "tpot": TPOT_BOUNDS_MS}

# Outcome statuses the gateway reports (recovery.gateway.app) and how each counts.
COUNTED = ("ok", "error", "shed")  # valid
NOT_COUNTED = ("rejected", "client_gone")  # a client's 4xx; a client that hung up
SHED_CODES = (429, 503)  # answered so by an overloaded node too: owed capacity, counted as shed

WINDOWS_S = {"rolling_28d": 28 * 86400, "rolling_30d": 30 * 86400}  # calendar_month: the month so far

BURN_WINDOWS_S: dict[str, int] = {
    "5m": 300,
    "30m": 1800,
    "1h": 3600,
    "2h": 7200,
    "6h": 6 * 3600,
    "1d": 86400,
    "3d": 3 * 86400,
}


@dataclass(frozen=True)
class BurnRule:
    """Alert when the burn rate is at least `factor` over both the long and the short window."""

    severity: str  # page or ticket
    long: str
    short: str
    factor: float
    budget_share: float  # of a 30-day budget spent by the time the long window fires at exactly `factor`

    def describe(self) -> str:
        return f"{self.severity}: {self.factor:g}× over {self.long} and {self.short}"


# The SRE workbook's recommended profile for a 30-day budget (table 5-8); applied as is to 28-day and calendar-month
# windows, as Sloth and Pyrra do.
PROFILE = "SRE workbook multiwindow, multi-burn-rate (30-day budget)"
SRE_WORKBOOK_RULES: tuple[BurnRule, ...] = (
    BurnRule("page", "1h", "5m", 14.4, 0.02),
    BurnRule("page", "6h", "30m", 6.0, 0.05),
    BurnRule("ticket", "1d", "2h", 3.0, 0.10),
    BurnRule("ticket", "3d", "6h", 1.0, 0.10),
)
# Below this many valid requests in a page rule's long window, it does not page: a handful of errors at night is a
# large share of very little traffic.
MIN_VALID_FOR_PAGE = 100


@dataclass(frozen=True)
class Targets:
    """One tier's latency thresholds (ms), which the rollup counts good against."""

    ttft_ms: float
    tpot_ms: float


@dataclass(frozen=True)
class Default:
    ttft_ms: int
    ttft_percentile: float
    tpot_ms: int
    tpot_percentile: float
    availability: float  # percent
    source: str


# MLPerf Inference (v4.0 to v5.1) LLM latency constraints, p99 TTFT / p99 TPOT: Llama-2-70B server 2,000 / 200 ms,
# interactive 450 / 40 ms; Llama-3.1-8B server 2,000 / 100 ms, interactive 500 / 30 ms; Mixtral-8x7B server
# 2,000 / 200 ms (no interactive scenario). Interactive maps to premium, server to standard; best effort keeps the
# server thresholds at p90 (our choice: it is shed first, so it is promised less). Availability is ours too: MLPerf
# has no availability constraint.
_LLAMA2_70B_SERVER = "MLPerf Inference Llama-2-70B server scenario (p99 TTFT 2,000 ms, p99 TPOT 200 ms)"
_LLAMA2_70B_INTERACTIVE = "MLPerf Inference Llama-2-70B interactive scenario (p99 TTFT 450 ms, p99 TPOT 40 ms)"
_LLAMA31_8B_SERVER = "MLPerf Inference Llama-3.1-8B server scenario (p99 TTFT 2,000 ms, p99 TPOT 100 ms)"
_LLAMA31_8B_INTERACTIVE = "MLPerf Inference Llama-3.1-8B interactive scenario (p99 TTFT 500 ms, p99 TPOT 30 ms)"
_BY_SIZE = {
    # A dense model of 30 to 70 B parameters (Qwen3-32B, the demo's; Llama-3-70B; Mixtral, 12.9 B active of 46.7 B,
    # whose MLPerf server figures equal Llama-2-70B's): Llama-2-70B's figures.
    "large": {
        "premium": Default(450, 99.0, 40, 99.0, 99.9, _LLAMA2_70B_INTERACTIVE),
        "standard": Default(2000, 99.0, 200, 99.0, 99.5, _LLAMA2_70B_SERVER),
        "best_effort": Default(2000, 90.0, 200, 90.0, 99.0, _LLAMA2_70B_SERVER + ", at p90"),
    },
    # Up to about 15 B (Llama-3-8B, Qwen3-14B): Llama-3.1-8B's figures.
    "small": {
        "premium": Default(500, 99.0, 30, 99.0, 99.9, _LLAMA31_8B_INTERACTIVE),
        "standard": Default(2000, 99.0, 100, 99.0, 99.5, _LLAMA31_8B_SERVER),
        "best_effort": Default(2000, 90.0, 100, 90.0, 99.0, _LLAMA31_8B_SERVER + ", at p90"),
    },
}
DEFAULT_SIZE = {"Llama-3-8B": "small", "Qwen3-14B": "small", "Tiny-Llama": "small"}


def default_for(model_key: str, tier: str) -> Default:
    """The shipped default objective of a model and tier (a tier added later gets standard's)."""
    by_tier = _BY_SIZE[DEFAULT_SIZE.get(model_key, "large")]
    return by_tier.get(tier, by_tier["standard"])


def month_start(at: datetime) -> datetime:
    """The start of at's calendar month (in at's time zone): a calendar-month window begins there."""
    return at.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def months_before(at: datetime, months: int) -> datetime:
    """The same day and time `months` calendar months earlier (the month's last day where it is shorter)."""
    index = at.year * 12 + at.month - 1 - months
    year, month = divmod(index, 12)
    month += 1
    days = (date(year + month // 12, month % 12 + 1, 1) - date(year, month, 1)).days
    return at.replace(year=year, month=month, day=min(at.day, days))


def window_start(window: str, now: datetime) -> datetime:
    """Where an objective's window begins: now minus 28 or 30 days, or the start of the calendar month."""
    if window == "calendar_month":
        return month_start(now)
    return now - timedelta(seconds=WINDOWS_S[window])


# --- histograms --------------------------------------------------------------------------------------------------
class NotABucketBound(ValueError):
    def __init__(self, kind: str, value: float, bounds: tuple[int, ...]):
        below = [b for b in bounds if b < value]
        above = [b for b in bounds if b > value]
        near = " and ".join(f"{b:,} ms" for b in (below[-1:] + above[:1]))
        super().__init__(
            f"{kind.upper()} threshold {value:g} ms is not a histogram bucket bound, so its attainment could not be "
            f"read exactly from the rollups: use {near}"
            + (f" (the bounds: {', '.join(str(b) for b in bounds)})" if not near else "")
        )
        self.nearest = tuple(below[-1:] + above[:1])


def check_threshold(kind: str, value: float) -> int:
    """The threshold as the bucket bound it must be; NotABucketBound (naming the nearest bounds) otherwise."""
    bounds = BOUNDS_MS[kind]
    if value in bounds:
        return int(value)
    raise NotABucketBound(kind, value, bounds)


def bucket_index(bounds: tuple[int, ...], value_ms: float) -> int:
    """The bucket a measurement lands in: the first whose bound is >= it; len(bounds) for the overflow bucket."""
    return bisect.bisect_left(bounds, value_ms)


def good_under(bounds: tuple[int, ...], counts: list[int], threshold_ms: float) -> int:
    """How many measurements are at or under a threshold that is a bucket bound: exact."""
    return sum(counts[: bisect.bisect_right(bounds, threshold_ms)])


def percentile(bounds: tuple[int, ...], counts: list[int], q: float) -> float | None:
    """The q-th percentile (0 < q <= 100) as the upper bound of the bucket it falls in (never below the true value,
    at most one bucket above it); math.inf when it falls past the last bound; None with no measurements."""
    total = sum(counts)
    if total == 0:
        return None
    rank = math.ceil(total * q / 100)
    seen = 0
    for i, n in enumerate(counts):
        seen += n
        if seen >= rank:
            return float(bounds[i]) if i < len(bounds) else math.inf
    return math.inf


def add_counts(into: list[int], more: Iterable[int]) -> list[int]:
    for i, n in enumerate(more):
        into[i] += n
    return into


# --- rolling outcomes up -----------------------------------------------------------------------------------------
@dataclass
class MinuteRollup:
    """What one minute of one model, tier and tenant's requests did, as additive counts."""

    valid: int = 0
    good: int = 0  # availability
    server_errors: int = 0
    shed: int = 0
    shed_by_level: dict[str, int] = field(default_factory=dict)
    client_errors: int = 0
    client_gone: int = 0
    ttft_valid: int = 0
    ttft_good: int = 0
    tpot_valid: int = 0
    tpot_good: int = 0
    joint_good: int = 0
    ttft_hist: list[int] = field(default_factory=lambda: [0] * (len(TTFT_BOUNDS_MS) + 1))
    tpot_hist: list[int] = field(default_factory=lambda: [0] * (len(TPOT_BOUNDS_MS) + 1))
    migrated: int = 0
    tokens_lost: int = 0
    completion_tokens: int = 0
    simulated: int = 0

    COUNTERS = (
        "valid",
        "good",
        "server_errors",
        "shed",
        "client_errors",
        "client_gone",
        "ttft_valid",
        "ttft_good",
        "tpot_valid",
        "tpot_good",
        "joint_good",
        "migrated",
        "tokens_lost",
        "completion_tokens",
        "simulated",
    )

    def add(
        self,
        status: str,
        code: int | None,
        ttft_ms: float | None,
        tpot_ms: float | None,
        targets: Targets,
        *,
        level: int | None = None,
        migrated: bool = False,
        tokens_lost: int = 0,
        completion_tokens: int = 0,
        simulated: bool = False,
    ) -> None:
        """Count one outcome against the latency thresholds it was owed (`targets`)."""
        self.migrated += bool(migrated)
        self.tokens_lost += tokens_lost
        self.completion_tokens += completion_tokens
        self.simulated += bool(simulated)
        if status == "rejected" and code in SHED_CODES:
            status = "shed"
        if status not in COUNTED:
            if status == "client_gone":
                self.client_gone += 1
            else:
                self.client_errors += 1
            return
        self.valid += 1
        if status == "shed":
            self.shed += 1
            key = str(level if level is not None else "?")
            self.shed_by_level[key] = self.shed_by_level.get(key, 0) + 1
            return
        if status == "error":
            self.server_errors += 1
        else:
            self.good += 1
        ttft_ok = tpot_ok = True
        if ttft_ms is not None:
            self.ttft_valid += 1
            self.ttft_hist[bucket_index(TTFT_BOUNDS_MS, ttft_ms)] += 1
            ttft_ok = ttft_ms <= targets.ttft_ms
            self.ttft_good += ttft_ok
        if tpot_ms is not None:
            self.tpot_valid += 1
            self.tpot_hist[bucket_index(TPOT_BOUNDS_MS, tpot_ms)] += 1
            tpot_ok = tpot_ms <= targets.tpot_ms
            self.tpot_good += tpot_ok
        self.joint_good += status == "ok" and ttft_ok and tpot_ok

    def merge(self, other: MinuteRollup) -> MinuteRollup:
        for name in self.COUNTERS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for level, n in other.shed_by_level.items():
            self.shed_by_level[level] = self.shed_by_level.get(level, 0) + n
        add_counts(self.ttft_hist, other.ttft_hist)
        add_counts(self.tpot_hist, other.tpot_hist)
        return self


# --- budgets and burn rates --------------------------------------------------------------------------------------
def attainment(good: int, valid: int) -> float | None:
    """good / valid; None (no data), never 100 %, when nothing counted."""
    return good / valid if valid else None


def burn_rate(good: int, valid: int, target: float) -> float | None:
    """How fast the budget burns: the bad share over the budget's share (1 = exactly on budget for the window)."""
    if not valid:
        return None
    return ((valid - good) / valid) / (1 - target)


def budget_remaining(good: int, valid: int, target: float) -> float | None:
    """Share of the error budget left: 1 − bad / (valid × (1 − target)); negative once overspent."""
    if not valid:
        return None
    return 1 - (valid - good) / (valid * (1 - target))


def goodput(joint_good: int, seconds: float) -> float | None:
    """Requests per second that met every objective of their tier (DistServe)."""
    return joint_good / seconds if seconds > 0 else None


@dataclass(frozen=True)
class AlertState:
    state: str  # page, ticket, ok, no data
    firing: tuple[str, ...]  # the rules that fire, described
    guarded: tuple[str, ...]  # page rules that would fire but for the minimum-traffic guard

    @property
    def badge(self) -> str:
        return {"page": "red", "ticket": "amber", "ok": "green"}.get(self.state, "grey")


def alert_state(
    rates: Mapping[str, float | None],
    valid: Mapping[str, int],
    *,
    rules: tuple[BurnRule, ...] = SRE_WORKBOOK_RULES,
    min_valid_for_page: int = MIN_VALID_FOR_PAGE,
) -> AlertState:
    """The multi-window multi-burn-rate state: a rule fires when the burn rate is at least its factor over both its
    windows; a page rule whose long window saw fewer than `min_valid_for_page` valid requests does not page."""
    if all(rates.get(rule.long) is None for rule in rules):
        return AlertState("no data", (), ())
    firing, guarded = [], []
    for rule in rules:
        long, short = rates.get(rule.long), rates.get(rule.short)
        if long is None or short is None or long < rule.factor or short < rule.factor:
            continue
        if rule.severity == "page" and valid.get(rule.long, 0) < min_valid_for_page:
            guarded.append(rule.describe())
            continue
        firing.append(rule)
    if any(rule.severity == "page" for rule in firing):
        state = "page"
    elif firing:
        state = "ticket"
    else:
        state = "ok"
    return AlertState(state, tuple(rule.describe() for rule in firing), tuple(guarded))


def budget_badge(remaining: float | None) -> str:
    """The colour of a remaining budget: green above half, amber above nothing, red when spent, grey with no data."""
    if remaining is None:
        return "grey"
    if remaining > 0.5:
        return "green"
    if remaining > 0:
        return "amber"
    return "red"
