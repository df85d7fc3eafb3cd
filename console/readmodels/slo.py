"""Service-level objectives as a manager reads them: attainment, error budget left and burn rates, each with the
counts and the formula behind it, summed from the per-minute rollups (never from raw outcomes).

One aggregate query per objective sums every figure for its window and for each burn-rate window at once.
"""

import datetime as dt

from django.conf import settings
from django.db.models import Count, Max, Min, Q, Sum
from django.db.models.functions import TruncDate
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
        result["daily"] = daily(objective, start, now, excluded if corrections else None)
    return result


def daily(objective: SloObjective, start: dt.datetime, now: dt.datetime, excluded: Q | None) -> list[dict]:
    """Per UTC day of the window: the good and valid counts of each indicator (the calendar and burn-down's data)."""
    rows = _rollups(objective).filter(minute__gte=start, minute__lte=now)
    if excluded is not None:
        rows = rows.exclude(excluded)
    fields = ("valid", "good", "ttft_valid", "ttft_good", "tpot_valid", "tpot_good", "joint_good", "shed")
    per_day = (
        rows.annotate(day=TruncDate("minute", tzinfo=dt.UTC))
        .values("day")
        .annotate(**{name: Sum(name) for name in fields})
        .order_by("day")
    )
    return [{"day": row["day"].isoformat(), **{name: row[name] for name in fields}} for row in per_day]


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
