"""SLA reports for managers: one period's service levels per model × tier (× tenant), beside the previous period of
equal length, with the degradation minutes, incidents, corrections and how complete the data is.

Every request figure is summed from the rollups, never from raw outcomes: whole UTC days from the per-day rollups
(SloDayRollup, kept with the minutes as they are stored), and from the per-minute rows only the days a correction
touches (its minutes left out) or a period's edge cuts; one SQL query for each, per UTC day and scope (histogram
buckets included), the previous period's counters the same way; Python adds the days up. `report()` returns one dict
that the page, the JSON, the CSV and the PDF all read.

Cost: a month of a busy cluster (150 scopes, 6.5 M minute rows) is 4,500 day rows (benchmarks/slo_report.py).
"""

import datetime as dt
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass

from django.db.models import FloatField, IntegerField, Max, OuterRef, Q, Subquery, Sum
from django.db.models.fields.json import KT, KeyTextTransform
from django.db.models.functions import Cast, TruncDate
from django.utils import timezone

from console.readmodels.slo import pct
from recovery.actions import slo as slo_actions
from recovery.choices import INCIDENT_SEVERITY_BADGE, EventKind, IncidentSeverity, Tier
from recovery.models import (
    DegradationChange,
    Incident,
    IncidentEvent,
    SloCorrection,
    SloDayCoverage,
    SloDayRollup,
    SloObjective,
    SloRollup,
)
from recovery.policy import slo as slo_policy
from recovery.policy.capacity import EFFECTS

PERIODS = ("week", "month", "quarter", "custom")
PERIOD_LABELS = {"week": "Last week", "month": "Last month", "quarter": "Last quarter", "custom": "Custom dates"}
LEVELS = (0, 1, 2, 3, 4)
PERCENTILES = (50, 90, 99)

# The additive counts of a rollup, summed per day; the previous period needs only the first ones.
CHANGE_FIELDS = ("valid", "good", "ttft_valid", "ttft_good", "tpot_valid", "tpot_good", "joint_good")
COUNT_FIELDS = (
    *CHANGE_FIELDS,
    "server_errors",
    "shed",
    "client_errors",
    "client_gone",
    "migrated",
    "tokens_lost",
    "completion_tokens",
    "simulated",
)
HIST_SIZES = {"ttft": len(slo_policy.TTFT_BOUNDS_MS) + 1, "tpot": len(slo_policy.TPOT_BOUNDS_MS) + 1}
# Each indicator with an objective: its good and valid counts, and the objective's target (percent) for it.
INDICATORS = {
    "availability": ("good", "valid", "availability_target"),
    "ttft": ("ttft_good", "ttft_valid", "ttft_percentile"),
    "tpot": ("tpot_good", "tpot_valid", "tpot_percentile"),
}
TIER_ORDER = {tier.value: i for i, tier in enumerate(Tier)}


def tier_label(tier: str) -> str:
    return Tier(tier).label if tier in Tier.values else tier


class ReportRefused(ValueError):
    """The period or format asked for cannot be reported; the message names what is allowed."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(message)


@dataclass(frozen=True)
class Period:
    kind: str
    start: dt.datetime  # inclusive, UTC midnight
    end: dt.datetime  # exclusive: midnight after the last day, or now for a custom period that ends today
    label: str

    @property
    def seconds(self) -> float:
        return (self.end - self.start).total_seconds()

    @property
    def previous(self) -> tuple[dt.datetime, dt.datetime]:
        """The period of equal length just before this one: what the change is measured against."""
        return self.start - (self.end - self.start), self.start

    def query(self, **more) -> dict:
        """The query string that asks for this period again (the download links)."""
        params = {"period": self.kind}
        if self.kind == "custom":
            params |= {"start": self.start.date().isoformat(), "end": self.last_day.isoformat()}
        return params | more

    @property
    def last_day(self) -> dt.date:
        return (self.end - dt.timedelta(microseconds=1)).date()


def _midnight(day: dt.date) -> dt.datetime:
    return dt.datetime(day.year, day.month, day.day, tzinfo=dt.UTC)


def last_complete(kind: str, now: dt.datetime) -> Period:
    """The last complete ISO week (Monday to Sunday), calendar month or calendar quarter before `now` (UTC)."""
    today = now.astimezone(dt.UTC).date()
    if kind == "week":
        end = today - dt.timedelta(days=today.weekday())
        start = end - dt.timedelta(days=7)
        year, week, _ = start.isocalendar()
        label = f"last week ({year}-W{week:02d}: {start:%Y-%m-%d} to {end - dt.timedelta(days=1):%Y-%m-%d})"
    elif kind == "month":
        end = today.replace(day=1)
        start = (end - dt.timedelta(days=1)).replace(day=1)
        label = f"last month ({start:%B %Y})"
    elif kind == "quarter":
        end = today.replace(month=3 * ((today.month - 1) // 3) + 1, day=1)
        start = slo_policy.months_before(_midnight(end), 3).date()
        label = f"last quarter ({start.year} Q{(start.month - 1) // 3 + 1})"
    else:
        raise ReportRefused("period", f"period must be one of {', '.join(PERIODS)}, not {kind!r}.")
    return Period(kind, _midnight(start), _midnight(end), label)


def allowed_range(now: dt.datetime) -> tuple[dt.date, dt.date]:
    """The first and last day a report may cover: rollups are kept 13 months (recovery.actions.slo.prune), and
    nothing after today has happened yet."""
    kept_from = slo_policy.months_before(now.astimezone(dt.UTC), slo_actions.ROLLUP_MONTHS)
    return kept_from.date() + dt.timedelta(days=1), now.astimezone(dt.UTC).date()


def _date(params: Mapping, name: str, allowed: str) -> dt.date:
    value = (params.get(name) or "").strip()
    if not value:
        raise ReportRefused(name, f"A custom period needs {name}=YYYY-MM-DD (UTC); {allowed}.")
    try:
        return dt.date.fromisoformat(value)
    except ValueError:
        raise ReportRefused(name, f"{name}={value!r} is not a date: write YYYY-MM-DD (UTC); {allowed}.") from None


def parse_period(params: Mapping, now: dt.datetime | None = None) -> Period:
    """The period a request asks for: `period=week|month|quarter` (the last complete one; month when absent), or
    `period=custom&start=YYYY-MM-DD&end=YYYY-MM-DD` (UTC days, both included). ReportRefused says what is wrong."""
    now = now or timezone.now()
    kind = (params.get("period") or "month").strip()
    if kind not in PERIODS:
        raise ReportRefused("period", f"period must be one of {', '.join(PERIODS)}, not {kind!r}.")
    if kind != "custom":
        return last_complete(kind, now)
    first, last = allowed_range(now)
    allowed = f"reports cover {first:%Y-%m-%d} to {last:%Y-%m-%d} (UTC; rollups are kept 13 months)"
    start, end = _date(params, "start", allowed), _date(params, "end", allowed)
    if start > end:
        raise ReportRefused("end", f"end {end} is before start {start}: {allowed}.")
    if end > last:
        raise ReportRefused("end", f"end {end} is in the future: {allowed}.")
    if start < first:
        raise ReportRefused("start", f"start {start} is older than the rollups kept: {allowed}.")
    period_end = min(_midnight(end + dt.timedelta(days=1)), now)
    label = f"{start:%Y-%m-%d} to {end:%Y-%m-%d}" + (" (to now)" if period_end == now else "")
    return Period("custom", _midnight(start), period_end, label)


# --- summing the rollups -------------------------------------------------------------------------------------------
def _bucket_sums() -> dict:
    """One SUM per histogram bucket: the buckets are JSON arrays, summed element by element in the database (as
    text, then an integer: on PostgreSQL ->> and a cast cost a third of -> and jsonb's own cast to integer)."""
    return {
        f"{kind}_{i}": Sum(Cast(KeyTextTransform(i, f"{kind}_hist"), IntegerField()))
        for kind, size in HIST_SIZES.items()
        for i in range(size)
    }


def _corrected(corrections: list[SloCorrection]) -> Q | None:
    """The rollup minutes the corrections exclude (each for every model and tier, or one model's, one tier's)."""
    q = None
    for correction in corrections:
        one = Q(minute__gte=correction.start.replace(second=0, microsecond=0), minute__lt=correction.end)
        if correction.model_key:
            one &= Q(model_key=correction.model_key)
        if correction.tier:
            one &= Q(tier=correction.tier)
        q = one if q is None else q | one
    return q


def _midnight_of(at: dt.datetime) -> dt.datetime:
    return at.astimezone(dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0)


def _split(
    start: dt.datetime, end: dt.datetime, corrections: list[SloCorrection], now: dt.datetime
) -> tuple[list[dt.date], list[tuple[dt.datetime, dt.datetime]]]:
    """The period's whole UTC days that the per-day rollups answer, and the spans the minutes must: a day a correction
    touches, or a day the period's edge cuts (unless the cut is at now: no minute after it exists yet)."""
    whole, spans = [], []
    day = _midnight_of(start)
    while day < end:
        following = day + dt.timedelta(days=1)
        lo, hi = max(start, day), min(end, following)
        exact = lo == day and (hi == following or hi >= now)
        touched = any(c.start < following and c.end > day for c in corrections)
        if exact and not touched:
            whole.append(day.date())
        else:
            spans.append((lo, hi))
        day = following
    return whole, spans


def daily_counts(
    start: dt.datetime,
    end: dt.datetime,
    by_tenant: bool,
    corrections: list[SloCorrection],
    now: dt.datetime,
    fields=COUNT_FIELDS,
    hist=True,
) -> list[dict]:
    """Per UTC day and model × tier (× tenant): the summed counts, and the summed histogram buckets."""
    scope = ["model_key", "tier", *(["tenant"] if by_tenant else [])]
    sums = {name: Sum(name) for name in fields} | (_bucket_sums() if hist else {})
    whole, spans = _split(start, end, corrections, now)
    per_day = list(
        SloDayRollup.objects.filter(day__in=whole).values("day", *scope).annotate(**sums).order_by("day", *scope)
    )
    if spans:
        minutes = SloRollup.objects.filter(_any(Q(minute__gte=lo, minute__lt=hi) for lo, hi in spans))
        excluded = _corrected(corrections)
        if excluded is not None:
            minutes = minutes.exclude(excluded)
        per_day += list(
            minutes.annotate(day=TruncDate("minute", tzinfo=dt.UTC))
            .values("day", *scope)
            .annotate(**sums)
            .order_by("day", *scope)
        )
    days = []
    for row in sorted(per_day, key=lambda r: (r["day"], *(r[name] for name in scope))):
        day = {
            "day": row["day"].isoformat(),
            "model": row["model_key"],
            "tier": row["tier"],
            "tenant": row.get("tenant"),
            **{name: row[name] or 0 for name in fields},
        }
        if hist:
            for kind, size in HIST_SIZES.items():
                day[f"{kind}_hist"] = [row[f"{kind}_{i}"] or 0 for i in range(size)]
        days.append(day)
    return days


def _any(qs) -> Q:
    result = Q()
    for q in qs:
        result |= q
    return result


def _empty_counts(fields=COUNT_FIELDS, hist=True) -> dict:
    counts = dict.fromkeys(fields, 0)
    if hist:
        counts |= {f"{kind}_hist": [0] * size for kind, size in HIST_SIZES.items()}
    return counts


def _add(into: dict, day: dict) -> dict:
    for name, value in into.items():
        if isinstance(value, list):
            slo_policy.add_counts(value, day[name])
        else:
            into[name] = value + day[name]
    return into


def _by_scope(days: list[dict], fields=COUNT_FIELDS, hist=True) -> dict[tuple, dict]:
    scopes: dict[tuple, dict] = {}
    for day in days:
        key = (day["model"], day["tier"], day["tenant"])
        _add(scopes.setdefault(key, _empty_counts(fields, hist)), day)
    return scopes


# --- figures -------------------------------------------------------------------------------------------------------
def _objectives() -> dict[tuple[str, str, str], SloObjective]:
    return {(o.model_key, o.tier, o.tenant): o for o in SloObjective.objects.all()}


def _objective_for(objectives: dict, model: str, tier: str, tenant: str | None) -> dict:
    """The objective a scope is held to: the tenant's own, else its tier's, else the shipped default."""
    objective = (tenant and objectives.get((model, tier, tenant))) or objectives.get((model, tier, ""))
    if objective is not None:
        return {
            "id": objective.pk,
            "scope": str(objective),
            "availability_target": objective.availability_target,
            "ttft_percentile": objective.ttft_percentile,
            "ttft_ms": objective.ttft_threshold_ms,
            "tpot_percentile": objective.tpot_percentile,
            "tpot_ms": objective.tpot_threshold_ms,
            "source": objective.source,
        }
    default = slo_policy.default_for(model, tier)
    return {
        "id": None,
        "scope": "shipped default (no objective set)",
        "availability_target": default.availability,
        "ttft_percentile": default.ttft_percentile,
        "ttft_ms": default.ttft_ms,
        "tpot_percentile": default.tpot_percentile,
        "tpot_ms": default.tpot_ms,
        "source": default.source,
    }


def _ms(value: float | None) -> str:
    if value is None:
        return "no data"
    return "over 60,000 ms" if value == float("inf") else f"{value:,.0f} ms"


def _per_second(value: float | None) -> str:
    if value is None:
        return "no data"
    return f"{value:,.2f} req/s" if value >= 1 else f"{value:.3g} req/s"


def _points(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:+.3f} pp"


def _rates(counts: dict, seconds: float) -> dict:
    """Attainments and goodput from summed counts: None (shown as "no data"), never 100 %, when nothing counted."""
    valid = counts["valid"]
    return {
        "requests": valid,
        "availability": slo_policy.attainment(counts["good"], valid),
        "ttft_attainment": slo_policy.attainment(counts["ttft_good"], counts["ttft_valid"]),
        "tpot_attainment": slo_policy.attainment(counts["tpot_good"], counts["tpot_valid"]),
        "joint_attainment": slo_policy.attainment(counts["joint_good"], valid),
        "goodput_rps": slo_policy.goodput(counts["joint_good"], seconds) if valid else None,
    }


def _change(now: dict, before: dict) -> dict:
    """This period against the previous one: attainments in percentage points, requests in percent."""
    change = {}
    for name in ("availability", "ttft_attainment", "tpot_attainment", "joint_attainment"):
        a, b = now[name], before[name]
        change[name] = a - b if a is not None and b is not None else None
        change[f"{name}_text"] = _points(change[name])
    requests = before["requests"]
    change["requests"] = (now["requests"] - requests) / requests if requests else None
    change["requests_text"] = "n/a" if change["requests"] is None else f"{100 * change['requests']:+.1f}%"
    return change


def scope_figures(counts: dict, objective: dict, seconds: float, previous: dict | None) -> dict:
    """One model × tier (× tenant): rates, percentiles from the summed buckets, and the budget left per objective."""
    rates = _rates(counts, seconds)
    figures = {**rates, "counts": {name: counts[name] for name in COUNT_FIELDS}}
    for name in ("availability", "ttft_attainment", "tpot_attainment", "joint_attainment"):
        figures[f"{name}_text"] = pct(rates[name], 3)
    figures["goodput_text"] = _per_second(rates["goodput_rps"])
    for kind, bounds in slo_policy.BOUNDS_MS.items():
        for q in PERCENTILES:
            value = slo_policy.percentile(bounds, counts[f"{kind}_hist"], q)
            figures[f"{kind}_p{q}_ms"] = None if value in (None, float("inf")) else value
            figures[f"{kind}_p{q}_text"] = _ms(value)
    budgets = []
    for indicator, (good_name, valid_name, target_name) in INDICATORS.items():
        target = objective[target_name] / 100
        good, valid = counts[good_name], counts[valid_name]
        remaining = slo_policy.budget_remaining(good, valid, target)
        attained = slo_policy.attainment(good, valid)
        budgets.append(
            {
                "indicator": indicator,
                "target": target,
                "good": good,
                "valid": valid,
                "bad": valid - good,
                "budget_remaining": remaining,
                "budget_text": pct(remaining, 1),
                "badge": slo_policy.budget_badge(remaining),
                "met": None if attained is None else attained >= target,
            }
        )
    figures["budgets"] = budgets
    left = [b["budget_remaining"] for b in budgets if b["budget_remaining"] is not None]
    figures["lowest_budget"] = min(left) if left else None
    if previous is not None:
        figures["previous"] = _rates(previous, seconds)
        figures["change"] = _change(rates, figures["previous"])
    return figures


def _degradation_minutes(start: dt.datetime, end: dt.datetime) -> dict:
    """Minutes at each degradation level from the level changes, per model and for the fleet (at each moment the
    worst model's level): each model's level in force at the start (its last change before it; 0 when none was ever
    recorded), then each change in the period."""
    at_start: dict[str, int] = {}
    for model_key, level in (
        DegradationChange.objects.filter(at__lte=start)
        .order_by("model_key", "-at", "-id")
        .values_list("model_key", "new_level")
    ):
        at_start.setdefault(model_key, level)  # the newest of each model's
    changes = list(
        DegradationChange.objects.filter(at__gt=start, at__lt=end)
        .order_by("at", "id")
        .values_list("at", "model_key", "new_level")
    )
    models = sorted(set(at_start) | {model_key for _, model_key, _ in changes})
    levels = {model_key: at_start.get(model_key, 0) for model_key in models}
    seconds = {model_key: dict.fromkeys(LEVELS, 0.0) for model_key in [*models, None]}  # None: the fleet's
    counted = dict.fromkeys(models, 0)
    since = start

    def elapse(until: dt.datetime) -> None:
        span = (until - since).total_seconds()
        for model_key, level in levels.items():
            seconds[model_key][level] += span
        seconds[None][max(levels.values(), default=0)] += span

    for at, model_key, new_level in changes:
        elapse(at)
        since, levels[model_key] = at, new_level
        counted[model_key] += 1
    elapse(end)

    def relaxed(of: dict) -> float:
        return sum(s for lvl, s in of.items() if EFFECTS[lvl].latency_slo_factor != 1.0) / 60

    def minutes(of: dict) -> list[dict]:
        return [{"level": level, "minutes": round(s / 60, 1)} for level, s in of.items()]

    fleet_relaxed = relaxed(seconds[None])
    return {
        "levels": minutes(seconds[None]),
        "changes": len(changes),
        "level_at_start": max(at_start.values(), default=0),
        # Each model's own levels: one model's loss sheds and relaxes only its own traffic.
        "by_model": [
            {
                "model": model_key or "whole fleet",
                "levels": minutes(seconds[model_key]),
                "changes": counted[model_key],
                "relaxed_minutes": round(relaxed(seconds[model_key]), 1),
            }
            for model_key in models
        ],
        # Level 3 and above relax the latency objectives while they hold: requests that finished then were counted
        # against the relaxed thresholds (recovery.actions.slo), which the report says.
        "relaxed_minutes": round(fleet_relaxed, 1),
        "relaxed_text": (
            f"For {fleet_relaxed:,.1f} minutes a model's level was 3 or more: its latency objectives were relaxed "
            f"×{max(e.latency_slo_factor for e in EFFECTS.values()):g} then, and its requests finishing in them were "
            "counted against the relaxed thresholds."
            if fleet_relaxed
            else ""
        ),
    }


def _incidents(start: dt.datetime, end: dt.datetime, budget: float) -> list[dict]:
    """Incidents whose first symptom falls in the period: time to detect, until latency was back and until capacity
    was back (recovered: what it lost serves again, its node or a spare; latency alone came back 28.9 s into a rack
    loss whose capacity took 1,478 s), the requests that failed, were shed and were moved while it lasted, the
    longest stall of a moved request, and the error budget each consumed: the requests that failed or were shed
    while it lasted (from the rollups, every model and tier) over the period's availability budget."""
    events = IncidentEvent.objects.filter(incident=OuterRef("pk"))
    first_symptom = events.filter(kind=EventKind.SYMPTOM).order_by("at", "id").values("description")[:1]
    longest_stall = (
        events.filter(kind=EventKind.REQUEST_MOVED)
        .values("incident")
        .annotate(longest=Max(Cast(KT("details__stall_ms"), FloatField())))
        .values("longest")
    )
    incidents = (
        Incident.objects.filter(opened_at__gte=start, opened_at__lt=end)
        .annotate(cause=Subquery(first_symptom), longest_stall_ms=Subquery(longest_stall))
        .order_by("opened_at", "pk")
    )
    rows = []
    for incident in incidents:
        ends = [t for t in (incident.recovered_at, incident.capacity_restored_at) if t]
        lasted_to = max(ends) if ends else (incident.closed_at or end)
        during = SloRollup.objects.filter(
            minute__gte=incident.opened_at.replace(second=0, microsecond=0), minute__lte=lasted_to
        ).aggregate(
            valid=Sum("valid"), good=Sum("good"), failed=Sum("server_errors"), shed=Sum("shed"), moved=Sum("migrated")
        )
        bad = (during["valid"] or 0) - (during["good"] or 0)
        consumed = bad / budget if budget else None
        detect_s = (incident.detected_at - incident.opened_at).total_seconds() if incident.detected_at else None
        capacity_s = (
            (incident.capacity_restored_at - incident.opened_at).total_seconds()
            if incident.capacity_restored_at
            else None
        )
        rows.append(
            {
                "id": incident.pk,
                "title": incident.title,
                "opened_at": incident.opened_at.isoformat(),
                "severity": incident.severity,
                "severity_label": IncidentSeverity(incident.severity).label,
                "severity_badge": INCIDENT_SEVERITY_BADGE[IncidentSeverity(incident.severity)],
                "cause": incident.cause or incident.title,
                "simulated": incident.simulated,
                "status": incident.status,
                "detect_s": detect_s,
                "latency_s": incident.recovery_time_s,  # first symptom → latency back within 10 % of the baseline
                "capacity_s": capacity_s,  # first symptom → what it lost serving again: recovered
                "failed": during["failed"] or 0,
                "shed": during["shed"] or 0,
                "moved": during["moved"] or 0,
                # Rounded once, here: the page and the PDF printed 912.5 ms as 913 and 912 (half up, half even).
                "longest_stall_ms": None
                if incident.longest_stall_ms is None
                else math.floor(incident.longest_stall_ms + 0.5),
                "bad_requests": bad,
                "budget_consumed": consumed,
                "budget_consumed_text": pct(consumed, 2) if consumed is not None else "n/a (no budget: no requests)",
            }
        )
    return rows


def _completeness(start: dt.datetime, end: dt.datetime, counts: dict) -> dict:
    """Minutes with rollups over minutes in the period (a minute without a rollup had no request, or lost its data:
    either way nothing there vouches for the service), and the share of requests that are generated history."""
    coverage = SloDayCoverage.objects.filter(day__gte=_midnight_of(start).date(), day__lt=end.astimezone(dt.UTC).date())
    if end > _midnight_of(end):  # a period to now: today's minutes so far
        coverage = coverage | SloDayCoverage.objects.filter(day=end.astimezone(dt.UTC).date())
    days = {day.isoformat(): minutes for day, minutes in coverage.order_by("day").values_list("day", "minutes")}
    with_data = sum(days.values())
    minutes = int((end - start).total_seconds() // 60)
    share = with_data / minutes if minutes else 0.0
    requests = counts["valid"] + counts["client_errors"] + counts["client_gone"]
    simulated = slo_policy.attainment(counts["simulated"], requests)
    return {
        "minutes": minutes,
        "minutes_with_rollups": with_data,
        "share": share,
        "share_text": pct(share, 1),
        "text": f"{pct(share, 1)} of the minutes in the period have rollups ({with_data:,} of {minutes:,})",
        "days_with_rollups": len(days),
        "per_day": days,
        "requests": requests,
        "simulated": counts["simulated"],
        "simulated_share": simulated,
        "simulated_text": (
            "no requests" if simulated is None else f"{pct(simulated, 1)} of requests are generated history"
        ),
    }


def _scope_key(row: dict) -> tuple:
    return row["model"], TIER_ORDER.get(row["tier"], 99), row["tier"], row["tenant"] or ""


def report(period: Period, by_tenant: bool = False, now: dt.datetime | None = None) -> dict:
    """The whole report for `period`: what the page shows and every download holds."""
    now = now or timezone.now()
    corrections = list(SloCorrection.objects.filter(start__lt=period.end, end__gt=period.start).order_by("start"))
    seconds = period.seconds
    days = daily_counts(period.start, period.end, by_tenant, corrections, now)
    prev_start, prev_end = period.previous
    before = list(SloCorrection.objects.filter(start__lt=prev_end, end__gt=prev_start))
    previous_days = daily_counts(prev_start, prev_end, by_tenant, before, now, fields=CHANGE_FIELDS, hist=False)
    previous = _by_scope(previous_days, CHANGE_FIELDS, hist=False)
    objectives = _objectives()

    rows = []
    for (model, tier, tenant), counts in _by_scope(days).items():
        objective = _objective_for(objectives, model, tier, tenant)
        before = previous.get((model, tier, tenant), _empty_counts(CHANGE_FIELDS, hist=False))
        rows.append(
            {
                "model": model,
                "tier": tier,
                "tier_label": tier_label(tier),
                "tenant": tenant,
                "scope": " · ".join(filter(None, (model, tier_label(tier), tenant))),
                "objective": objective,
                **scope_figures(counts, objective, seconds, before),
            }
        )
    rows.sort(key=_scope_key)

    total = _empty_counts()
    for day in days:
        _add(total, day)
    total_before = _empty_counts(CHANGE_FIELDS, hist=False)
    for day in previous_days:
        _add(total_before, day)
    # The availability budget of the whole period: each scope's valid requests × (1 − its target).
    budget = sum(
        r["counts"]["valid"] * (1 - r["objective"]["availability_target"] / 100) for r in rows if r["counts"]["valid"]
    )
    bad = total["valid"] - total["good"]
    totals = {**_rates(total, seconds), "counts": {name: total[name] for name in COUNT_FIELDS}}
    totals["change"] = _change(totals, _rates(total_before, seconds))
    for name in ("availability", "ttft_attainment", "tpot_attainment", "joint_attainment"):
        totals[f"{name}_text"] = pct(totals[name], 3)
    totals["goodput_text"] = _per_second(totals["goodput_rps"])
    totals["availability_budget"] = budget
    totals["availability_budget_used"] = bad / budget if budget else None
    totals["availability_budget_used_text"] = pct(totals["availability_budget_used"], 1) if budget else "no data"

    shed_by_tier = {}
    for row in rows:
        shed_by_tier[row["tier"]] = shed_by_tier.get(row["tier"], 0) + row["counts"]["shed"]
    degradation = _degradation_minutes(period.start, period.end)
    degradation["shed_by_tier"] = [
        {"tier": tier, "tier_label": tier_label(tier), "shed": shed_by_tier[tier]}
        for tier in sorted(shed_by_tier, key=lambda t: TIER_ORDER.get(t, 99))
    ]
    incidents = _incidents(period.start, period.end, budget)
    worst = min((r for r in rows if r["lowest_budget"] is not None), key=lambda r: r["lowest_budget"], default=None)

    return {
        "period": {
            "kind": period.kind,
            "label": period.label,
            "start": period.start.isoformat(),
            "end": period.end.isoformat(),
            "last_day": period.last_day.isoformat(),
            "days": round(seconds / 86400, 2),
            "previous_start": prev_start.isoformat(),
            "previous_end": prev_end.isoformat(),
        },
        "generated_at": now.isoformat(),
        "by_tenant": by_tenant,
        "has_data": total["valid"] > 0,
        "totals": totals,
        "worst": {"scope": worst["scope"], "budget_text": pct(worst["lowest_budget"], 1)} if worst else None,
        "rows": rows,
        "daily": days,
        "completeness": _completeness(period.start, period.end, total),
        "degradation": degradation,
        "migrations": {"migrated": total["migrated"], "tokens_lost": total["tokens_lost"]},
        "incidents": incidents,
        "corrections": [
            {
                "id": c.pk,
                "start": c.start.isoformat(),
                "end": c.end.isoformat(),
                "scope": f"{c.model_key or 'every model'} · {c.get_tier_display() or 'every tier'}",
                "reason": c.reason,
                "by": c.created_by,
            }
            for c in corrections
        ],
        "charts": _charts(rows, days),
    }


def _charts(rows: list[dict], days: list[dict]) -> dict:
    """What the charts draw, on the page (Plotly) and in the PDF (reportlab) alike."""
    per_day: dict[str, dict] = {}
    for day in days:
        _add(per_day.setdefault(day["day"], _empty_counts(CHANGE_FIELDS, hist=False)), day)
    daily = {
        "days": list(per_day),
        "requests": [c["valid"] for c in per_day.values()],
        "availability": [slo_policy.attainment(c["good"], c["valid"]) for c in per_day.values()],
        "joint_attainment": [slo_policy.attainment(c["joint_good"], c["valid"]) for c in per_day.values()],
    }
    budgets = {
        "scopes": [r["scope"] for r in rows],
        **{
            indicator: [next(b["budget_remaining"] for b in r["budgets"] if b["indicator"] == indicator) for r in rows]
            for indicator in INDICATORS
        },
    }
    return {"daily": daily, "budgets": budgets}


def recovery_summary(incidents: list[dict]) -> str:
    """How long the period's incidents took to recover, recovered meaning capacity back (not latency alone)."""
    if not incidents:
        return "no incident"
    back = sorted(i["capacity_s"] for i in incidents if i["capacity_s"] is not None)
    pending = len(incidents) - len(back)
    if not back:
        return f"capacity not back yet in {pending} of {len(incidents)}"
    text = f"capacity back in median {statistics.median(back):,.1f} s, longest {back[-1]:,.1f} s"
    return text + (f"; not back yet in {pending} of {len(incidents)}" if pending else "")


def headline(data: dict) -> list[tuple[str, str]]:
    """The figures a manager reads first (the e-mail's body, the PDF's first lines)."""
    totals, worst = data["totals"], data["worst"]
    return [
        ("Period", data["period"]["label"]),
        ("Requests", f"{totals['requests']:,} ({totals['change']['requests_text']} on the previous period)"),
        ("Availability", f"{totals['availability_text']} ({totals['change']['availability_text']})"),
        ("Joint attainment", f"{totals['joint_attainment_text']} ({totals['change']['joint_attainment_text']})"),
        ("Goodput", totals["goodput_text"]),
        ("Availability budget used", totals["availability_budget_used_text"]),
        ("Least budget left", f"{worst['scope']}: {worst['budget_text']}" if worst else "no data"),
        ("Incidents", str(len(data["incidents"]))),
        ("Time to recover", recovery_summary(data["incidents"])),
        ("Migrations", f"{data['migrations']['migrated']:,}"),
        ("Tokens lost", f"{data['migrations']['tokens_lost']:,}"),
        ("Data completeness", data["completeness"]["text"]),
    ]
