"""Service-level objectives: their edits and corrections (validated, audited, whatever the door), and the roll-up of
request outcomes into per-minute rows, from which every SLO figure is read.

The roll-up is incremental and idempotent. Each run takes one lock (the progress row: a row lock on PostgreSQL, the
write lock on SQLite) before it reads anything, counts the outcomes not yet rolled up, adds them to their minutes'
rows (creating those that do not exist yet, adding to those that do: a late outcome lands in its own minute), and
marks them rolled up, all in one transaction. A re-run finds nothing left; a second worker waits for the lock and
then finds only what the first did not take. Each outcome carries its own mark rather than the run keeping only a
high-water id: ids are handed out when a row is inserted but become visible when its transaction commits, so a
lower id can appear after a higher one was counted, and a bare id watermark would skip it for ever.

The stream consumer takes a shorter path (store_rolled_up): it counts its outcomes in the transaction that inserts
them, already marked, so each outcome is written once and never read back; the periodic roll-up then counts only
what came in some other way.
"""

import datetime as dt
import json
import logging
from collections.abc import Iterable

from django.conf import settings
from django.db import connection, models, transaction
from django.db.models import Q
from django.utils import timezone

from recovery.actions import audit
from recovery.forms import SloCorrectionForm, SloObjectiveForm
from recovery.models import (
    RequestOutcome,
    SloCorrection,
    SloDayCoverage,
    SloDayRollup,
    SloObjective,
    SloRollup,
    SloRollupState,
)
from recovery.policy import slo as slo_policy
from recovery.policy.capacity import EFFECTS

log = logging.getLogger(__name__)

OBJECTIVE_FIELDS = tuple(SloObjectiveForm.Meta.fields)
ROLLUP_MONTHS = 13  # rollups are kept this long; raw outcomes for LIFELINE_OUTCOME_RETENTION_DAYS


class SloRefused(ValueError):
    """A value is malformed or not allowed; `errors` maps each bad field to why."""

    def __init__(self, errors: dict[str, str]):
        self.errors = errors
        self.field = next(iter(errors))
        super().__init__("; ".join(errors.values()))


def _refused(form) -> SloRefused:
    return SloRefused({name: " ".join(errors) for name, errors in form.errors.items()})


def describe(objective: SloObjective) -> dict:
    return {name: getattr(objective, name) for name in OBJECTIVE_FIELDS}


# --- objectives ----------------------------------------------------------------------------------------------------
def default_values(model_key: str, tier: str) -> dict:
    default = slo_policy.default_for(model_key, tier)
    return {
        "model_key": model_key,
        "tier": tier,
        "tenant": "",
        "ttft_threshold_ms": default.ttft_ms,
        "ttft_percentile": default.ttft_percentile,
        "tpot_threshold_ms": default.tpot_ms,
        "tpot_percentile": default.tpot_percentile,
        "availability_target": default.availability,
        "window": "rolling_30d",
        "source": default.source,
    }


def ensure_objectives(scopes: Iterable[tuple[str, str]], actor: str = "system") -> list[SloObjective]:
    """The shipped default objective for each (model, tier) that has none yet; created and audited."""
    wanted = set(scopes)
    have = set(SloObjective.objects.filter(tenant="").values_list("model_key", "tier"))
    created = []
    for model_key, tier in sorted(wanted - have):
        values = default_values(model_key, tier)
        with transaction.atomic():
            objective, made = SloObjective.objects.get_or_create(
                model_key=model_key, tier=tier, tenant="", defaults={**values, "updated_by": actor}
            )
            if made:
                audit.record(
                    actor,
                    "slo_objective_created",
                    f"slo:{objective.pk}",
                    f"shipped default: {values['source']}",
                    values=describe(objective),
                )
                created.append(objective)
    return created


def create_objective(values: dict, actor: str, reason: str = "") -> SloObjective:
    form = SloObjectiveForm({**{"tenant": "", "window": "rolling_30d"}, **values})
    if not form.is_valid():
        raise _refused(form)
    with transaction.atomic():
        objective = form.save(commit=False)
        objective.updated_by = actor
        objective.source = str(values.get("source") or f"set by {actor}")
        objective.save()
        audit.record(actor, "slo_objective_created", f"slo:{objective.pk}", reason, values=describe(objective))
    return objective


def update_objective(objective: SloObjective, values: dict, actor: str, reason: str = "") -> dict[str, list]:
    """Change some of an objective's figures ({field: value}; the rest keep theirs). Returns {field: [old, new]}.

    Good counts already rolled up keep the thresholds in force when their requests finished; the histograms let
    a report re-read them against the new ones, since every threshold is a bucket bound."""
    unknown = sorted(set(values) - set(OBJECTIVE_FIELDS))
    if unknown:
        raise SloRefused(
            {unknown[0]: f"{unknown[0]}: not a field of an objective; they are {', '.join(OBJECTIVE_FIELDS)}"}
        )
    with transaction.atomic():
        row = SloObjective.objects.select_for_update().get(pk=objective.pk)
        form = SloObjectiveForm({**describe(row), **values}, instance=row)
        if not form.is_valid():
            raise _refused(form)
        old = describe(SloObjective.objects.get(pk=row.pk))
        changed = {
            name: [old[name], form.cleaned_data[name]]
            for name in OBJECTIVE_FIELDS
            if old[name] != form.cleaned_data[name]
        }
        if changed:
            objective = form.save(commit=False)
            objective.updated_by = actor
            objective.updated_at = timezone.now()
            objective.save()
            audit.record(actor, "slo_objective_changed", f"slo:{row.pk}", reason, changed=changed)
    return changed


def delete_objective(objective: SloObjective, actor: str, reason: str = "") -> None:
    """Remove an objective (its rollups stay: they belong to the traffic, not to the objective)."""
    with transaction.atomic():
        audit.record(actor, "slo_objective_deleted", f"slo:{objective.pk}", reason, values=describe(objective))
        objective.delete()


def refuse_edit(actor: str, role: str | None, target: str, what: str) -> None:
    """Someone without the admin role tried to change an objective or a correction: logged and audited."""
    log.warning("%s (role %s) may not %s %s: only admins edit objectives", actor, role, what, target)
    audit.record(
        actor, "slo_edit_refused", target, f"role {role or 'none'} may not {what}: only admins edit objectives"
    )


# --- corrections ---------------------------------------------------------------------------------------------------
def add_correction(values: dict, actor: str) -> SloCorrection:
    """Exclude a period from the objectives (all, or one model's, one tier's), with a reason; audited."""
    form = SloCorrectionForm({"model_key": "", "tier": "", **values})
    if not form.is_valid():
        raise _refused(form)
    with transaction.atomic():
        correction = form.save(commit=False)
        correction.created_by = actor
        correction.save()
        audit.record(
            actor,
            "slo_correction_added",
            f"slo-correction:{correction.pk}",
            correction.reason,
            start=correction.start.isoformat(),
            end=correction.end.isoformat(),
            model=correction.model_key,
            tier=correction.tier,
        )
    return correction


def withdraw_correction(correction: SloCorrection, actor: str, reason: str = "") -> None:
    with transaction.atomic():
        audit.record(
            actor,
            "slo_correction_withdrawn",
            f"slo-correction:{correction.pk}",
            reason,
            start=correction.start.isoformat(),
            end=correction.end.isoformat(),
            excluded_because=correction.reason,
        )
        correction.delete()


def corrections_for(objective: SloObjective) -> list[SloCorrection]:
    return list(
        SloCorrection.objects.filter(Q(model_key="") | Q(model_key=objective.model_key)).filter(
            Q(tier="") | Q(tier=objective.tier)
        )
    )


# --- outcomes to rollups -------------------------------------------------------------------------------------------
_OUTCOME_FIELDS = (
    "id",
    "model_key",
    "tier",
    "tenant",
    "finished_at",
    "status",
    "http_status",
    "ttft_ms",
    "tpot_ms",
    "degradation_level",
    "migrations",
    "tokens_lost",
    "completion_tokens",
    "simulated",
)


def _owed_targets() -> dict[tuple[str, str, str], slo_policy.Targets]:
    """(model, tier, tenant) → thresholds; tenant "" holds the tier's, which a tenant without its own is owed."""
    return {(o.model_key, o.tier, o.tenant): o.targets for o in SloObjective.objects.all()}


def _lock_progress() -> SloRollupState:
    SloRollupState.objects.get_or_create(pk=1)
    # A write first: it takes the row lock on PostgreSQL and the database's write lock on SQLite before any read.
    SloRollupState.objects.filter(pk=1).update(last_run_at=timezone.now())
    return SloRollupState.objects.select_for_update().get(pk=1)


def roll_up(batch_size: int = 5000, max_batches: int = 50) -> int:
    """Count every outcome not yet rolled up into its minute's row; returns how many were counted."""
    total = 0
    for _ in range(max_batches):
        counted = roll_up_batch(batch_size)
        total += counted
        if counted < batch_size:
            break
    return total


def roll_up_batch(batch_size: int = 5000) -> int:
    with transaction.atomic():
        progress = _lock_progress()
        rows = list(
            RequestOutcome.objects.filter(rolled_up=False).order_by("id").values_list(*_OUTCOME_FIELDS)[:batch_size]
        )
        if not rows:
            return 0
        _store(_count(rows))
        ids = [row[0] for row in rows]
        for start in range(0, len(ids), 2000):
            RequestOutcome.objects.filter(id__in=ids[start : start + 2000]).update(rolled_up=True)
        _advance(progress, ids)
    return len(rows)


def store_rolled_up(outcomes: list[RequestOutcome]) -> None:
    """Insert new outcomes already counted in their minutes, in one transaction: the stream consumer's path, with no
    second read and no second write of each row. If counting fails, nothing is inserted (the caller's entries stay
    unacknowledged)."""
    if not outcomes:
        return
    with transaction.atomic():
        progress = _lock_progress()
        for outcome in outcomes:
            outcome.rolled_up = True
        if connection.vendor == "postgresql":
            _copy(outcomes)
        else:
            RequestOutcome.objects.bulk_create(outcomes)
        _store(_count([tuple(getattr(o, name) for name in _OUTCOME_FIELDS) for o in outcomes]))
        _advance(progress, [o.id for o in outcomes])


def _copy(outcomes: list[RequestOutcome]) -> None:
    """PostgreSQL's COPY, for the stream's thousands of rows a second: a third of the time of an INSERT built by the
    ORM, most of which goes to preparing each of the 24 fields of each row. The rows get no ids back."""
    fields = [f for f in RequestOutcome._meta.concrete_fields if not f.primary_key]
    encoded = {f.attname for f in fields if isinstance(f, models.JSONField)}
    names = [f.attname for f in fields]
    columns = ", ".join(connection.ops.quote_name(f.column) for f in fields)
    with (
        connection.cursor() as cursor,
        cursor.cursor.copy(
            f"COPY {connection.ops.quote_name(RequestOutcome._meta.db_table)} ({columns}) FROM STDIN"
        ) as copy,
    ):
        for outcome in outcomes:
            values = [getattr(outcome, name) for name in names]
            copy.write_row([json.dumps(v) if n in encoded else v for n, v in zip(names, values, strict=True)])


def _advance(progress: SloRollupState, ids: list[int | None]) -> None:
    """Count the outcomes; the highest id moves only with ids known (PostgreSQL's COPY hands none back)."""
    progress.rolled_through_id = max([progress.rolled_through_id, *(i for i in ids if i is not None)])
    progress.outcomes_rolled += len(ids)
    progress.last_batch = len(ids)
    progress.save(update_fields=["rolled_through_id", "outcomes_rolled", "last_batch"])


def _count(rows: list[tuple]) -> dict[tuple[str, str, str, dt.datetime], slo_policy.MinuteRollup]:
    """Rows in _OUTCOME_FIELDS' order → their minutes' counts, each against the thresholds its tier was owed."""
    ensure_objectives({(row[1], row[2]) for row in rows})
    owed = _owed_targets()
    minutes: dict[tuple[str, str, str, dt.datetime], slo_policy.MinuteRollup] = {}
    for (
        _,
        model_key,
        tier,
        tenant,
        finished_at,
        status,
        code,
        ttft,
        tpot,
        level,
        migrations,
        lost,
        tokens,
        simulated,
    ) in rows:
        targets = owed.get((model_key, tier, tenant)) or owed[(model_key, tier, "")]
        factor = EFFECTS[level].latency_slo_factor if level in EFFECTS else 1.0
        if factor != 1.0:  # level 3 relaxes the latency objectives while it holds
            targets = slo_policy.Targets(targets.ttft_ms * factor, targets.tpot_ms * factor)
        key = (model_key, tier, tenant, finished_at.replace(second=0, microsecond=0))
        minute = minutes.get(key)
        if minute is None:
            minute = minutes[key] = slo_policy.MinuteRollup()
        minute.add(
            status,
            code,
            ttft,
            tpot,
            targets,
            level=level,
            migrated=bool(migrations),
            tokens_lost=lost,
            completion_tokens=tokens,
            simulated=simulated,
        )
    return minutes


_ROLLUP_VALUES = [*slo_policy.MinuteRollup.COUNTERS, "shed_by_level", "ttft_hist", "tpot_hist"]


def _store(minutes: dict[tuple[str, str, str, dt.datetime], slo_policy.MinuteRollup]) -> None:
    """Add each minute's counts to its row and to its day's, or create them, in one upsert each, and count the
    minutes new to their day's coverage. Runs under the roll-up's lock: no other writer, so the rows read here are
    the rows written over."""
    if not minutes:
        return
    stamps = {key[3] for key in minutes}
    covered = set(SloRollup.objects.filter(minute__in=stamps).values_list("minute", flat=True).distinct())
    _upsert(SloRollup, "minute", minutes)
    days: dict[tuple[str, str, str, dt.date], slo_policy.MinuteRollup] = {}
    for (model_key, tier, tenant, minute), counts in minutes.items():
        key = (model_key, tier, tenant, minute.astimezone(dt.UTC).date())
        days[key] = days[key].merge(counts) if key in days else slo_policy.MinuteRollup().merge(counts)
    _upsert(SloDayRollup, "day", days)
    new_minutes: dict[dt.date, int] = {}
    for stamp in stamps - covered:
        day = stamp.astimezone(dt.UTC).date()
        new_minutes[day] = new_minutes.get(day, 0) + 1
    if new_minutes:
        known = dict(SloDayCoverage.objects.filter(day__in=new_minutes).values_list("day", "minutes"))
        SloDayCoverage.objects.bulk_create(
            [SloDayCoverage(day=day, minutes=known.get(day, 0) + n) for day, n in new_minutes.items()],
            update_conflicts=True,
            unique_fields=["day"],
            update_fields=["minutes"],
        )


def _upsert(model, when: str, counts_by_key: dict) -> None:
    """(model, tier, tenant, minute or day) → counts, added to the rows there are, the others created."""
    whens = [key[3] for key in counts_by_key]
    existing = {
        (row.model_key, row.tier, row.tenant, getattr(row, when)): row
        for row in model.objects.filter(
            **{f"{when}__gte": min(whens), f"{when}__lte": max(whens)},
            model_key__in={key[0] for key in counts_by_key},
            tier__in={key[1] for key in counts_by_key},
            tenant__in={key[2] for key in counts_by_key},
        )
    }
    rows = []
    for key, counts in counts_by_key.items():
        row = existing.get(key)
        merged = counts if row is None else _from_row(row).merge(counts)
        rows.append(model(model_key=key[0], tier=key[1], tenant=key[2], **{when: key[3]}, **_fields(merged)))
    model.objects.bulk_create(
        rows,
        batch_size=1000,
        update_conflicts=True,
        unique_fields=["model_key", "tier", "tenant", when],
        update_fields=_ROLLUP_VALUES,
    )


def _fields(counts: slo_policy.MinuteRollup) -> dict:
    return {
        **{name: getattr(counts, name) for name in slo_policy.MinuteRollup.COUNTERS},
        "shed_by_level": counts.shed_by_level,
        "ttft_hist": counts.ttft_hist,
        "tpot_hist": counts.tpot_hist,
    }


def _from_row(row: SloRollup) -> slo_policy.MinuteRollup:
    counts = slo_policy.MinuteRollup(**{name: getattr(row, name) for name in slo_policy.MinuteRollup.COUNTERS})
    counts.shed_by_level = dict(row.shed_by_level)
    slo_policy.add_counts(counts.ttft_hist, row.ttft_hist)
    slo_policy.add_counts(counts.tpot_hist, row.tpot_hist)
    return counts


# --- retention -----------------------------------------------------------------------------------------------------
def prune(now: dt.datetime | None = None, chunk: int = 10_000) -> dict[str, int]:
    """Delete raw outcomes past their retention (only those already rolled up: nothing uncounted is lost) and
    rollups older than 13 months."""
    now = now or timezone.now()
    cutoff = now - dt.timedelta(days=settings.LIFELINE_OUTCOME_RETENTION_DAYS)
    outcomes = 0
    while True:
        ids = list(
            RequestOutcome.objects.filter(finished_at__lt=cutoff, rolled_up=True).values_list("id", flat=True)[:chunk]
        )
        if not ids:
            break
        RequestOutcome.objects.filter(id__in=ids).delete()
        outcomes += len(ids)
    kept_from = slo_policy.months_before(now, ROLLUP_MONTHS)
    rollups, _ = SloRollup.objects.filter(minute__lt=kept_from).delete()
    # A day is kept while any of its minutes is: the first day kept may be partly pruned, its sums stay whole.
    SloDayRollup.objects.filter(day__lt=kept_from.astimezone(dt.UTC).date()).delete()
    SloDayCoverage.objects.filter(day__lt=kept_from.astimezone(dt.UTC).date()).delete()
    if outcomes or rollups:
        SloRollupState.objects.get_or_create(pk=1)
        state = SloRollupState.objects.get(pk=1)
        state.pruned_outcomes += outcomes
        state.last_pruned_at = now
        state.save(update_fields=["pruned_outcomes", "last_pruned_at"])
    return {"outcomes": outcomes, "rollups": rollups}
