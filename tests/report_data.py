"""Raw request outcomes for the SLA report's tests, rolled up the way the control plane rolls them
(recovery.actions.slo.roll_up), and the report's figures recomputed from those raw outcomes by a route of the test's
own: plain counting and a nearest-rank percentile over the raw values, never the rollups."""

import datetime as dt
import math
import random
import shutil

import pytest

from recovery.actions import slo
from recovery.models import RequestOutcome, SloObjective
from recovery.policy.slo import TPOT_BOUNDS_MS, TTFT_BOUNDS_MS

MODELS = ("Qwen3-32B", "Llama-3-8B")
TIERS = ("premium", "standard", "best_effort")
TENANTS = ("acme", "globex")
MOVE = {"from": "node-01", "to": "node-02", "method": "transfer"}
STATUS_CODE = {"ok": 200, "error": 502, "shed": 429, "rejected": 400, "client_gone": 499}


def outcomes(start: dt.datetime, day_offsets, per_day: int, seed: int, prefix: str) -> list[RequestOutcome]:
    """`per_day` outcomes on each of the days `day_offsets` after `start`, between 01:00 and 23:00 UTC, of every
    status, with latencies on both sides of each tier's thresholds; a few moved (never with a token lost)."""
    rng = random.Random(seed)
    rows = []
    for offset in day_offsets:
        for i in range(per_day):
            status = rng.choices(list(STATUS_CODE), [0.86, 0.04, 0.04, 0.03, 0.03])[0]
            served = status in ("ok", "client_gone")
            finished = start + dt.timedelta(days=offset, hours=1, seconds=rng.uniform(0, 22 * 3600))
            rows.append(
                RequestOutcome(
                    request_id=f"{prefix}-{offset}-{i}",
                    gateway="gw-test",
                    tenant=rng.choice(TENANTS),
                    tier=rng.choice(TIERS),
                    model_key=rng.choice(MODELS),
                    node="node-01",
                    status=status,
                    http_status=STATUS_CODE[status],
                    degradation_level=2 if status == "shed" else 0,
                    ttft_ms=rng.lognormvariate(6.2, 0.7) if served else None,
                    tpot_ms=rng.lognormvariate(3.4, 0.5) if served and rng.random() > 0.05 else None,
                    e2e_ms=1000.0,
                    completion_tokens=120 if served else 0,
                    started_at=finished - dt.timedelta(seconds=1),
                    finished_at=finished,
                    migrations=[{"from": "node-01", "to": "node-02", "method": "transfer"}]
                    if rng.random() < 0.02
                    else [],
                )
            )
    return rows


def store_and_roll_up(rows: list[RequestOutcome]) -> None:
    RequestOutcome.objects.bulk_create(rows)
    slo.roll_up(batch_size=5000, max_batches=1000)


def _bound(bounds: tuple[int, ...], value: float) -> float:
    """The upper bound of the bucket a raw value falls in: what a percentile read from the histogram reports."""
    return float(next((b for b in bounds if b >= value), math.inf))


def nearest_rank(values: list[float], q: float, bounds: tuple[int, ...]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return _bound(bounds, ordered[max(math.ceil(len(ordered) * q / 100) - 1, 0)])


def recompute(rows: list[RequestOutcome], start: dt.datetime, end: dt.datetime, by_tenant: bool = False) -> dict:
    """Per (model, tier[, tenant]): the counts and figures of the outcomes that finished in [start, end)."""
    objectives = {(o.model_key, o.tier): o for o in SloObjective.objects.filter(tenant="")}
    scopes: dict[tuple, dict] = {}
    for row in rows:
        if not start <= row.finished_at < end:
            continue
        key = (row.model_key, row.tier, row.tenant if by_tenant else None)
        s = scopes.setdefault(
            key,
            {"valid": 0, "good": 0, "ttft_valid": 0, "ttft_good": 0, "tpot_valid": 0, "tpot_good": 0, "joint_good": 0}
            | {"shed": 0, "migrated": 0, "tokens_lost": 0, "ttft": [], "tpot": []},
        )
        objective = objectives[(row.model_key, row.tier)]
        s["migrated"] += bool(row.migrations)
        s["tokens_lost"] += row.tokens_lost
        if row.status in ("rejected", "client_gone"):
            continue
        s["valid"] += 1
        if row.status == "shed":
            s["shed"] += 1
            continue
        s["good"] += row.status == "ok"
        ttft_ok = tpot_ok = True
        if row.ttft_ms is not None:
            ttft_ok = row.ttft_ms <= objective.ttft_threshold_ms
            s["ttft_valid"] += 1
            s["ttft_good"] += ttft_ok
            s["ttft"].append(row.ttft_ms)
        if row.tpot_ms is not None:
            tpot_ok = row.tpot_ms <= objective.tpot_threshold_ms
            s["tpot_valid"] += 1
            s["tpot_good"] += tpot_ok
            s["tpot"].append(row.tpot_ms)
        s["joint_good"] += row.status == "ok" and ttft_ok and tpot_ok
    seconds = (end - start).total_seconds()
    for (model, tier, _), s in scopes.items():
        objective = objectives[(model, tier)]
        s["availability"] = s["good"] / s["valid"] if s["valid"] else None
        s["ttft_attainment"] = s["ttft_good"] / s["ttft_valid"] if s["ttft_valid"] else None
        s["tpot_attainment"] = s["tpot_good"] / s["tpot_valid"] if s["tpot_valid"] else None
        s["joint_attainment"] = s["joint_good"] / s["valid"] if s["valid"] else None
        s["goodput_rps"] = s["joint_good"] / seconds if s["valid"] else None
        for q in (50, 90, 99):
            s[f"ttft_p{q}_ms"] = nearest_rank(s["ttft"], q, TTFT_BOUNDS_MS)
            s[f"tpot_p{q}_ms"] = nearest_rank(s["tpot"], q, TPOT_BOUNDS_MS)
        s["budgets"] = {
            "availability": _left(s["good"], s["valid"], objective.availability_target),
            "ttft": _left(s["ttft_good"], s["ttft_valid"], objective.ttft_percentile),
            "tpot": _left(s["tpot_good"], s["tpot_valid"], objective.tpot_percentile),
        }
    return scopes


def _left(good: int, valid: int, target_percent: float) -> float | None:
    if not valid:
        return None
    allowed = valid * (1 - target_percent / 100)
    return 1 - (valid - good) / allowed


def pdftotext() -> str:
    """Poppler's pdftotext; `./lifeline test` installs Debian's poppler-utils where it can (root and apt-get)."""
    path = shutil.which("pdftotext")
    if path:
        return path
    if shutil.which("apt-get"):
        pytest.fail("pdftotext is missing: install Debian's poppler-utils (`apt-get install -y poppler-utils`)")
    pytest.skip("pdftotext is missing and apt-get is unavailable here to install poppler-utils")
