"""Service-level objectives as a manager reads them: attainment, error budget left and burn rates, each with the
counts and the formula behind it, summed from the per-minute rollups (never from raw outcomes).

One aggregate query per objective sums every figure for its window and for each burn-rate window at once; one
objective's own page adds two more, per UTC day (its histograms summed bucket by bucket) and per hour.
"""

import datetime as dt
import math

from django.conf import settings
from django.db.models import Count, IntegerField, Max, Min, Q, Sum
from django.db.models.fields.json import KT
from django.db.models.functions import Cast, TruncDate, TruncHour
from django.utils import timezone

from recovery.actions import slo as slo_actions
from recovery.models import SloObjective, SloRollup, SloRollupState
from recovery.policy import slo as slo_policy

# Counts summed over the objective's window; the burn-rate windows need only the first ones.
BURN_FIELDS = ("valid", "good", "ttft_valid", "ttft_good", "tpot_valid", "tpot_good")
WINDOW_FIELDS = (*BURN_FIELDS, "joint_good", "server_errors", "shed", "migrated", "tokens_lost", "simulated")
# Each indicator: its good and valid counts, and how its name and target read.
INDICATORS = {
    "availability": ("good", "valid"),
    "ttft": ("ttft_good", "ttft_valid"),
    "tpot": ("tpot_good", "tpot_valid"),
}


def pct(value: float | None, digits: int = 2) -> str:
    return "no data" if value is None else f"{100 * value:.{digits}f}%"


def share_text(part: int, whole: int, digits: int = 1) -> str:
    """`part` of `whole` as a percentage that is 100 % or 0 % only when it is: 99,999 of 100,000 is "> 99.9%", not
    "100.0%" (the objectives page said all of a window was generated history while it held live requests)."""
    if not whole:
        return "no data"
    text = pct(part / whole, digits)
    step = 10.0**-digits
    if part < whole and text == pct(1.0, digits):
        return f"> {100 - step:.{digits}f}%"
    if part > 0 and text == pct(0.0, digits):
        return f"< {step:.{digits}f}%"
    return text


def rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}×"


def target_of(objective: SloObjective, indicator: str) -> float:
    return {
        "availability": objective.availability_target,
        "ttft": objective.ttft_percentile,
        "tpot": objective.tpot_percentile,
    }[indicator] / 100


def indicator_name(objective: SloObjective, indicator: str) -> str:
    if indicator == "availability":
        return f"Availability ≥ {objective.availability_target:g}%"
    if indicator == "ttft":
        return f"TTFT p{objective.ttft_percentile:g} ≤ {objective.ttft_threshold_ms:,} ms"
    return f"TPOT p{objective.tpot_percentile:g} ≤ {objective.tpot_threshold_ms:,} ms"


def _excluded(objective: SloObjective) -> tuple[Q, list[dict]]:
    """The corrections that cover this objective: a filter that drops their minutes, and the list to show."""
    q = Q()
    shown = []
    for correction in slo_actions.corrections_for(objective):
        start = correction.start.replace(second=0, microsecond=0)
        q |= Q(minute__gte=start, minute__lt=correction.end)
        shown.append(
            {
                "id": correction.pk,
                "start": correction.start.isoformat(),
                "end": correction.end.isoformat(),
                "reason": correction.reason,
                "by": correction.created_by,
            }
        )
    return q, shown


def _rollups(objective: SloObjective):
    rows = SloRollup.objects.filter(model_key=objective.model_key, tier=objective.tier)
    return rows.filter(tenant=objective.tenant) if objective.tenant else rows


def objective_status(objective: SloObjective, now: dt.datetime | None = None, detail: bool = False) -> dict:
    now = now or timezone.now()
    start = slo_policy.window_start(objective.window, now)
    burn_starts = {name: now - dt.timedelta(seconds=s) for name, s in slo_policy.BURN_WINDOWS_S.items()}
    earliest = min(start, *burn_starts.values())
    excluded, corrections = _excluded(objective)
    rows = _rollups(objective).filter(minute__gte=earliest.replace(second=0, microsecond=0), minute__lte=now)
    if corrections:
        rows = rows.exclude(excluded)
    in_window = Q(minute__gte=start)
    aggregates = {f"w_{name}": Sum(name, filter=in_window) for name in WINDOW_FIELDS}
    aggregates["w_minutes"] = Count("minute", distinct=True, filter=in_window)
    aggregates["w_first"] = Min("minute", filter=in_window)
    aggregates["w_last"] = Max("minute", filter=in_window)
    for window, since in burn_starts.items():
        for name in BURN_FIELDS:
            aggregates[f"{window}_{name}"] = Sum(name, filter=Q(minute__gte=since))
    sums = {
        key: (value or 0) if not key.endswith(("_first", "_last")) else value
        for key, value in rows.aggregate(**aggregates).items()
    }
    window = {name: sums[f"w_{name}"] for name in WINDOW_FIELDS}

    # Completeness: the share of the window that data covers, from its first minute with any request to now.
    window_s = (now - start).total_seconds()
    covered_s = (now - sums["w_first"]).total_seconds() if sums["w_first"] else 0.0
    completeness = min(1.0, covered_s / window_s) if window_s > 0 else 0.0

    indicators = []
    for indicator, (good_name, valid_name) in INDICATORS.items():
        target = target_of(objective, indicator)
        good, valid = window[good_name], window[valid_name]
        rates = {
            w: slo_policy.burn_rate(sums[f"{w}_{good_name}"], sums[f"{w}_{valid_name}"], target)
            for w in slo_policy.BURN_WINDOWS_S
        }
        valid_by_window = {w: sums[f"{w}_{valid_name}"] for w in slo_policy.BURN_WINDOWS_S}
        alert = slo_policy.alert_state(
            rates, valid_by_window, min_valid_for_page=settings.LIFELINE_SLO_MIN_VALID_FOR_PAGE
        )
        attained = slo_policy.attainment(good, valid)
        remaining = slo_policy.budget_remaining(good, valid, target)
        indicators.append(
            {
                "indicator": indicator,
                "name": indicator_name(objective, indicator),
                "target": target,
                "good": good,
                "valid": valid,
                "bad": valid - good,
                "attainment": attained,
                "attainment_text": pct(attained, 3),
                "attainment_how": f"good/valid = {good:,}/{valid:,}" if valid else "no valid requests in the window",
                "budget_remaining": remaining,
                "budget_text": pct(remaining, 1),
                "budget_how": (
                    f"1 − bad/(valid × (1 − target)) = 1 − {valid - good:,}/({valid:,} × {1 - target:.4g})"
                    if valid
                    else "no valid requests in the window"
                ),
                "budget_badge": slo_policy.budget_badge(remaining),
                "burn_rates": rates,
                "burn_rates_text": {w: rate(r) for w, r in rates.items()},
                "burn_valid": valid_by_window,
                "burn_good": {w: sums[f"{w}_{good_name}"] for w in slo_policy.BURN_WINDOWS_S},
                "burn_how": "burn rate = (1 − good/valid over the window) / (1 − target)",
                "alert": alert.state,
                "alert_badge": alert.badge,
                "alert_firing": list(alert.firing),
                "alert_guarded": list(alert.guarded),
            }
        )
    joint = slo_policy.attainment(window["joint_good"], window["valid"])
    goodput_s = covered_s
    result = {
        "id": objective.pk,
        "model": objective.model_key,
        "tier": objective.tier,
        "tier_label": objective.get_tier_display(),
        "tenant": objective.tenant or None,
        "scope": str(objective),
        "window": objective.window,
        "window_label": objective.get_window_display(),
        "window_start": start.isoformat(),
        "now": now.isoformat(),
        "source": objective.source,
        "updated_at": objective.updated_at.isoformat(),
        "updated_by": objective.updated_by,
        "thresholds": {
            "ttft_ms": objective.ttft_threshold_ms,
            "ttft_percentile": objective.ttft_percentile,
            "tpot_ms": objective.tpot_threshold_ms,
            "tpot_percentile": objective.tpot_percentile,
            "availability": objective.availability_target,
        },
        "has_data": window["valid"] > 0,
        "completeness": completeness,
        "completeness_text": (
            f"{pct(completeness, 0)} of the window ({sums['w_minutes']:,} minutes with requests since "
            f"{sums['w_first']:%Y-%m-%d %H:%M} UTC)"
            if sums["w_first"]
            else "no data in the window"
        ),
        "minutes_with_data": sums["w_minutes"],
        "last_minute": sums["w_last"].isoformat() if sums["w_last"] else None,
        "counts": window,
        "simulated_text": (
            f"{share_text(window['simulated'], window['valid'])} of the window's requests are generated history"
            + (f" ({window['valid'] - window['simulated']:,} served)" if window["valid"] > window["simulated"] else "")
        ),
        "indicators": indicators,
        "joint_attainment": joint,
        "joint_text": pct(joint, 3),
        "joint_how": (
            f"joint good/valid = {window['joint_good']:,}/{window['valid']:,}: answered within every latency objective"
            if window["valid"]
            else "no valid requests in the window"
        ),
        "goodput_rps": slo_policy.goodput(window["joint_good"], goodput_s) if window["valid"] else None,
        "goodput_how": (
            f"joint good / seconds covered = {window['joint_good']:,} / {goodput_s:,.0f} s" if window["valid"] else ""
        ),
        "corrections": corrections,
        "profile": slo_policy.PROFILE,
        "min_valid_for_page": settings.LIFELINE_SLO_MIN_VALID_FOR_PAGE,
    }
    remaining = [i["budget_remaining"] for i in indicators if i["budget_remaining"] is not None]
    result["lowest_budget"] = min(remaining) if remaining else None
    states = [i["alert"] for i in indicators]
    result["alert"] = next((s for s in ("page", "ticket", "ok") if s in states), "no data")
    if detail:
        result.update(objective_detail(objective, result, start, now, excluded if corrections else None))
    return result


# --- one objective's page (/slo/<id>/ and GET /api/slo/<id>): days, calendar, bands, burn-down, burn-rate table ------
DAY_FIELDS = (*BURN_FIELDS, "joint_good", "shed", "server_errors", "client_errors", "client_gone", "simulated")
HISTOGRAMS = {"ttft": ("ttft_hist", slo_policy.TTFT_BOUNDS_MS), "tpot": ("tpot_hist", slo_policy.TPOT_BOUNDS_MS)}
PERCENTILES = (50, 90, 99)
# A day's state, and the objective's alert state, as badge colours.
STATE_BADGE = {"met": "green", "missed": "red", "no data": "grey", "page": "red", "ticket": "amber", "ok": "green"}
INDICATOR_LABELS = {"availability": "Availability", "ttft": "TTFT", "tpot": "TPOT"}


def objective_detail(
    objective: SloObjective, status: dict, start: dt.datetime, now: dt.datetime, excluded: Q | None
) -> dict:
    """What one objective's page adds to its status: two more aggregate queries over its rollups (per day, per hour),
    and each indicator's figures written out as formulas with their counts."""
    for indicator in status["indicators"]:
        good, valid, bad, target = indicator["good"], indicator["valid"], indicator["bad"], indicator["target"]
        indicator["attainment_formula"] = (
            f"attainment = good ÷ valid = {good:,} ÷ {valid:,}" if valid else "attainment: no valid requests"
        )
        indicator["budget_formula"] = (
            f"budget left = 1 − bad ÷ (valid × (1 − target)) = 1 − {bad:,} ÷ ({valid:,} × {1 - target:.4g})"
            if valid
            else "budget left: no valid requests"
        )
        indicator["budget_spent"] = (
            f"{bad:,} bad of the {valid * (1 - target):,.1f} the window allows" if valid else "nothing counted"
        )
    days = daily(objective, start, now, excluded)
    return {
        "alert_badge": STATE_BADGE.get(status["alert"], "grey"),
        "daily": days,
        "calendar": calendar(days, start, now),
        "bands": bands(objective, days),
        "burn_down": burn_down(objective, status, start, now, excluded),
        "burn_table": burn_table(status),
        "burn_rules": burn_rules(status),
        "simulated": simulated_share(days),
    }


class HistogramBucket(Cast):
    """One bucket of a rollup's histogram (its JSON list of counts) as an integer.

    On SQLite a plain JSON_EXTRACT: Django's key transform asks each value's JSON type before extracting it, which
    parses the list twice, and the per-day query reads all 53 buckets of every minute's row (half the page's time
    over a month of minutes). Elsewhere (PostgreSQL's jsonb) the key transform as Django writes it."""

    def __init__(self, field: str, index: int):
        super().__init__(KT(f"{field}__{index}"), IntegerField())
        self.index = index

    def as_sqlite(self, compiler, connection, **extra_context):
        column, params = compiler.compile(self.get_source_expressions()[0].lhs)
        return f"JSON_EXTRACT({column}, %s)", (*params, f"$[{self.index}]")


def _bucket_sums(kind: str) -> dict:
    """A histogram summed bucket by bucket in the database: one SUM per element of the JSON list."""
    name, bounds = HISTOGRAMS[kind]
    return {f"{kind}_{i}": Sum(HistogramBucket(name, i)) for i in range(len(bounds) + 1)}


def _ms(value: float | None, bounds: tuple[int, ...]) -> str:
    if value is None:
        return "no data"
    if math.isinf(value):
        return f"> {bounds[-1]:,} ms"
    return f"{value:,.0f} ms"


def _meets(attained: float, target: float) -> bool:
    # Rounded: 99.9 / 100 is 0.9990000000000001 in binary, which 999 good of 1,000 would otherwise miss.
    return round(attained, 9) >= round(target, 9)


def daily(objective: SloObjective, start: dt.datetime, now: dt.datetime, excluded: Q | None) -> list[dict]:
    """Per UTC day of the window: each indicator's good and valid counts and whether the day met its target, and the
    TTFT and TPOT histograms summed bucket by bucket with p50, p90 and p99 read from them. A day without a request
    has no row: it is "no data", never 100 %."""
    rows = _rollups(objective).filter(minute__gte=start, minute__lte=now)
    if excluded is not None:
        rows = rows.exclude(excluded)
    per_day = (
        rows.annotate(day=TruncDate("minute", tzinfo=dt.UTC))
        .values("day")
        .annotate(**{name: Sum(name) for name in DAY_FIELDS}, **_bucket_sums("ttft"), **_bucket_sums("tpot"))
        .order_by("day")
    )
    days = []
    for row in per_day:
        day = {"day": row["day"].isoformat(), **{name: row[name] for name in DAY_FIELDS}}
        day["requests"] = day["valid"] + day["client_errors"] + day["client_gone"]
        day["requests_text"], day["simulated_text"] = f"{day['requests']:,}", f"{day['simulated']:,}"
        day["indicators"] = {}
        for indicator, (good_name, valid_name) in INDICATORS.items():
            good, valid = day[good_name], day[valid_name]
            attained = slo_policy.attainment(good, valid)
            day["indicators"][indicator] = {
                "label": INDICATOR_LABELS[indicator],
                "good": good,
                "valid": valid,
                "attainment": attained,
                "attainment_text": pct(attained),
                "met": None if attained is None else _meets(attained, target_of(objective, indicator)),
                "how": f"{good:,} ÷ {valid:,}" if valid else "",
            }
        verdicts = [i["met"] for i in day["indicators"].values() if i["met"] is not None]
        day["state"] = "no data" if not verdicts else "met" if all(verdicts) else "missed"
        for kind, (_, bounds) in HISTOGRAMS.items():
            hist = [row[f"{kind}_{i}"] or 0 for i in range(len(bounds) + 1)]
            read = {f"p{q}": slo_policy.percentile(bounds, hist, q) for q in PERCENTILES}
            day[f"{kind}_hist"] = hist
            day[f"{kind}_measured"] = sum(hist)
            day[f"{kind}_measured_text"] = f"{sum(hist):,}"
            # Past the last bound reads as infinity, which JSON cannot carry: null, and the text says "> last bound".
            day[f"{kind}_ms"] = {p: None if v is None or math.isinf(v) else v for p, v in read.items()}
            day[f"{kind}_text"] = {p: _ms(v, bounds) for p, v in read.items()}
        days.append(day)
    return days


def calendar(days: list[dict], start: dt.datetime, now: dt.datetime) -> list[list[dict | None]]:
    """The window's UTC days as weeks from Monday: each met, missed or "no data"; None pads the first and last week."""
    by_day = {d["day"]: d for d in days}
    day, last = start.astimezone(dt.UTC).date(), now.astimezone(dt.UTC).date()
    weeks: list[list[dict | None]] = []
    week: list[dict | None] = [None] * day.weekday()
    while day <= last:
        data = by_day.get(day.isoformat())
        state = data["state"] if data else "no data"
        week.append(
            {
                "day": day.isoformat(),
                "label": f"{day:%a} {day:%b} {day.day}",
                "state": state,
                "badge": STATE_BADGE[state],
                "requests": data["requests"] if data else 0,
                "simulated": data["simulated"] if data else 0,
                "simulated_text": data["simulated_text"] if data else "0",
                "indicators": data["indicators"] if data else {},
            }
        )
        if len(week) == 7:
            weeks.append(week)
            week = []
        day += dt.timedelta(days=1)
    if week:
        weeks.append(week + [None] * (7 - len(week)))
    return weeks


def bands(objective: SloObjective, days: list[dict]) -> dict:
    """TTFT and TPOT p50, p90 and p99 per day (the days with measurements), and the objective's threshold."""
    result = {}
    for kind, threshold, percentile in (
        ("ttft", objective.ttft_threshold_ms, objective.ttft_percentile),
        ("tpot", objective.tpot_threshold_ms, objective.tpot_percentile),
    ):
        measured = [d for d in days if d[f"{kind}_measured"]]
        result[kind] = {
            "days": [d["day"] for d in measured],
            "measured": [d[f"{kind}_measured"] for d in measured],
            **{f"p{q}": [d[f"{kind}_ms"][f"p{q}"] for d in measured] for q in PERCENTILES},
            "threshold_ms": threshold,
            "percentile": percentile,
            "last_bound_ms": HISTOGRAMS[kind][1][-1],
        }
    return result


def burn_down(objective: SloObjective, status: dict, start: dt.datetime, now: dt.datetime, excluded: Q | None) -> dict:
    """The error budget left through the window, hour by hour: 1 − bad so far ÷ (valid in the window × (1 − target)).
    It ends at the window's budget left; the ideal line spends the budget evenly, all of it by the window's end."""
    rows = _rollups(objective).filter(minute__gte=start, minute__lte=now)
    if excluded is not None:
        rows = rows.exclude(excluded)
    hours = list(
        rows.annotate(hour=TruncHour("minute", tzinfo=dt.UTC))
        .values("hour")
        .annotate(**{name: Sum(name) for name in BURN_FIELDS})
        .order_by("hour")
    )
    series = {}
    for indicator in status["indicators"]:
        good_name, valid_name = INDICATORS[indicator["indicator"]]
        allowed = indicator["valid"] * (1 - indicator["target"])  # the bad requests the whole window may have
        t: list[float] = []
        remaining: list[float] = []
        if allowed:
            t, remaining, bad = [start.timestamp()], [1.0], 0
            for row in hours:
                if row[valid_name]:
                    bad += row[valid_name] - row[good_name]
                    t.append(min(row["hour"] + dt.timedelta(hours=1), now).timestamp())
                    remaining.append(1 - bad / allowed)
        series[indicator["indicator"]] = {"name": indicator["name"], "t": t, "remaining": remaining}
    # A calendar month's budget lasts to the month's end; a rolling window's ends now.
    end = slo_policy.months_before(start, -1) if objective.window == "calendar_month" else now
    return {
        "indicators": series,
        "ideal": {"t": [start.timestamp(), end.timestamp()], "remaining": [1.0, 0.0]},
        "how": "budget left at t = 1 − bad up to t ÷ (valid in the window × (1 − target)), per hour (UTC)",
    }


def burn_table(status: dict) -> list[dict]:
    """Each burn-rate window's rate per indicator, with its counts and the formula."""
    rows = []
    for window in slo_policy.BURN_WINDOWS_S:
        cells = []
        for indicator in status["indicators"]:
            good, valid = indicator["burn_good"][window], indicator["burn_valid"][window]
            cells.append(
                {
                    "indicator": indicator["indicator"],
                    "rate": indicator["burn_rates"][window],
                    "rate_text": indicator["burn_rates_text"][window],
                    "good": good,
                    "valid": valid,
                    "how": (
                        f"({valid - good:,} ÷ {valid:,}) ÷ {1 - indicator['target']:.4g}"
                        if valid
                        else "no valid requests"
                    ),
                }
            )
        rows.append({"window": window, "cells": cells})
    return rows


def burn_rules(status: dict) -> list[dict]:
    """The profile's rules, each with its two windows' rates per indicator and whether it fires."""
    rules = []
    for rule in slo_policy.SRE_WORKBOOK_RULES:
        described = rule.describe()
        cells = []
        for indicator in status["indicators"]:
            if described in indicator["alert_firing"]:
                state = "fires"
            elif described in indicator["alert_guarded"]:
                state = "below the traffic guard"
            else:
                state = "quiet"
            cells.append(
                {
                    "indicator": indicator["indicator"],
                    "long": indicator["burn_rates_text"][rule.long],
                    "short": indicator["burn_rates_text"][rule.short],
                    "state": state,
                }
            )
        rules.append(
            {
                "rule": described,
                "severity": rule.severity,
                "long": rule.long,
                "short": rule.short,
                "factor": rule.factor,
                "budget_share": rule.budget_share,
                "cells": cells,
            }
        )
    return rules


def simulated_share(days: list[dict]) -> dict:
    """How much of the window is generated history (the demo's back-fill) rather than served requests."""
    simulated = sum(d["simulated"] for d in days)
    requests = sum(d["requests"] for d in days)
    generated = [d["day"] for d in days if d["simulated"]]
    share = simulated / requests if requests else None
    if simulated:
        text = (
            f"{simulated:,} of the window's {requests:,} requests ({share_text(simulated, requests)}) are generated "
            "history, not served "
            f"requests: on {len(generated)} of its {len(days)} days with data, {generated[0]} to {generated[-1]}"
        )
    else:
        text = "None: every request counted here was served."
    return {"requests": requests, "simulated": simulated, "share": share, "days": generated, "text": text}


def all_objectives(now: dt.datetime | None = None) -> list[dict]:
    """Every objective, the one with the least budget left first; those with no data last."""
    now = now or timezone.now()
    statuses = [objective_status(o, now) for o in SloObjective.objects.all()]
    return sorted(statuses, key=lambda s: (s["lowest_budget"] is None, s["lowest_budget"] or 0, s["scope"]))


def indicator_rows(statuses: list[dict]) -> list[dict]:
    """One row per objective and indicator, sorted by remaining budget (no data last): the /slo/ table."""
    rows = [{**indicator, "objective": status} for status in statuses for indicator in status["indicators"]]
    return sorted(
        rows,
        key=lambda r: (r["budget_remaining"] is None, r["budget_remaining"] or 0, r["objective"]["scope"], r["name"]),
    )


def rollup_progress() -> dict:
    state = SloRollupState.objects.filter(pk=1).first()
    if state is None:
        return {"outcomes_rolled": 0, "last_run_at": None}
    return {
        "outcomes_rolled": state.outcomes_rolled,
        "last_run_at": state.last_run_at.isoformat() if state.last_run_at else None,
        "rolled_through_id": state.rolled_through_id,
    }
