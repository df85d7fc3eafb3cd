"""SLO roll-up throughput: request outcomes per second one worker process rolls into per-minute rollups.

The gateways report ~5,000 requests/s at the goal; the Celery worker must store them and count them into their
minutes at least that fast. The stream consumer does both in one transaction per 2,000 outcomes
(recovery.actions.streams `store_outcomes`, recovery.actions.slo `store_rolled_up`); outcomes that came in another
way (rows from before an upgrade, a bulk load) are left to the periodic roll-up (`roll_up`). This stores N generated
outcomes (10 models × 3 tiers × 5 tenants, spread over 30 minutes, 2% of them arriving after their minute already
has a row) through the stream path into a scratch database of its own, then N/10 more through the periodic path,
times both in this one process, and checks the rollups hold exactly the outcomes counted.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/lifeline python -m benchmarks.slo_rollup [--outcomes 100000]

With a PostgreSQL DATABASE_URL it creates and drops a database of its own next to it; otherwise a SQLite file.
"""

import argparse
import datetime as dt
import os
import random
import sys
import time

from benchmarks.common import BASE_DIR, save, scratch_database

GOAL_PER_S = 5000


def _reports(n: int, start: dt.datetime, rng: random.Random) -> list[tuple[str, dict]]:
    models = [f"model-{i}" for i in range(10)]
    tiers = ["premium", "standard", "best_effort"]
    tenants = [f"tenant-{i}" for i in range(5)]
    items = []
    for i in range(n):
        status = rng.choices(["ok", "error", "shed", "rejected", "client_gone"], [0.95, 0.01, 0.02, 0.01, 0.01])[0]
        served = status in ("ok", "error", "client_gone")
        items.append(
            (
                f"gw-{i % 4}",
                {
                    "request_id": f"b-{i}",
                    "tenant": rng.choice(tenants),
                    "tier": rng.choice(tiers),
                    "model": rng.choice(models),
                    "status": status,
                    "http_status": {"ok": 200, "error": 502, "shed": 429, "rejected": 400, "client_gone": 499}[status],
                    "degradation_level": 2 if status == "shed" else 0,
                    "ttft_ms": rng.lognormvariate(5.8, 0.5) if served else None,
                    "tpot_ms": rng.lognormvariate(3.3, 0.3) if served else None,
                    "e2e_ms": 0.0,
                    "completion_tokens": 200,
                    "started_at": (start + dt.timedelta(seconds=1800 * i / n)).timestamp(),
                },
            )
        )
    return items


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outcomes", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=5000, help="outcomes per roll-up transaction")
    args = parser.parse_args()

    url, drop = scratch_database("slo")
    os.environ["DATABASE_URL"] = url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
    sys.path.insert(0, str(BASE_DIR))
    try:
        import django

        django.setup()
        from django.core.management import call_command
        from django.db import connection
        from django.db.models import Sum

        from recovery.actions import slo, streams
        from recovery.models import RequestOutcome, SloRollup

        call_command("migrate", verbosity=0)
        rng = random.Random(5)
        start = dt.datetime.now(dt.UTC).replace(second=0, microsecond=0) - dt.timedelta(hours=1)
        items = _reports(args.outcomes, start, rng)
        late = rng.sample(items, len(items) // 50)  # these arrive after their minute was rolled up
        late_ids = {data["request_id"] for _, data in late}
        on_time = [item for item in items if item[1]["request_id"] not in late_ids]

        stored_s = stored_cpu_s = 0.0
        for lot in (on_time, late):
            for first in range(0, len(lot), 2000):  # the stream consumer reads 2,000 entries at a time
                t, cpu = time.perf_counter(), time.process_time()
                streams.store_outcomes(lot[first : first + 2000])
                stored_s += time.perf_counter() - t
                stored_cpu_s += time.process_time() - cpu
        # The periodic path: outcomes stored without being counted, then rolled up in batches.
        others = _reports(args.outcomes // 10, start, rng)
        for item in others:
            item[1]["request_id"] = "other-" + item[1]["request_id"]
        for first in range(0, len(others), 2000):
            RequestOutcome.objects.bulk_create(streams.outcome_rows(others[first : first + 2000]))
        t = time.perf_counter()
        periodic = slo.roll_up(batch_size=args.batch, max_batches=10**6)
        rolled_s = time.perf_counter() - t

        counted = SloRollup.objects.aggregate(valid=Sum("valid"), errors=Sum("client_errors"), gone=Sum("client_gone"))
        total = sum(counted.values())
        expected = args.outcomes + len(others)
        assert periodic == len(others), f"the periodic roll-up counted {periodic} of {len(others)}"
        assert total == expected, f"rollups hold {total} outcomes of {expected}"
        assert not RequestOutcome.objects.filter(rolled_up=False).exists()
        stream_rate = args.outcomes / stored_s
        periodic_rate = len(others) / rolled_s
        print(
            f"{connection.vendor}: stored and counted {args.outcomes:,} outcomes from the stream in {stored_s:.2f} s = "
            f"{stream_rate:,.0f}/s (goal {GOAL_PER_S:,}/s: {stream_rate / GOAL_PER_S:.1f}×; the worker's own CPU "
            f"{stored_cpu_s:.2f} s, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores); the periodic "
            f"roll-up counted {len(others):,} stored outcomes in {rolled_s:.2f} s = {periodic_rate:,.0f}/s",
            file=sys.stderr,
        )
        save(
            "slo_rollup",
            {
                "database": connection.vendor,
                "outcomes": args.outcomes,
                "late_outcomes": len(late),
                "rollup_rows": SloRollup.objects.count(),
                "stream_store_and_count_s": round(stored_s, 3),
                "stream_store_and_count_per_s": round(stream_rate),
                "stream_worker_cpu_s": round(stored_cpu_s, 3),
                "periodic_outcomes": len(others),
                "periodic_batch": args.batch,
                "periodic_rollup_s": round(rolled_s, 3),
                "periodic_rollup_per_s": round(periodic_rate),
                "load_average_1m": round(os.getloadavg()[0], 2),
                "goal_per_s": GOAL_PER_S,
                "stream_vs_goal": round(stream_rate / GOAL_PER_S, 2),
                "note": "measured, one process, as one Celery worker runs it; the machine is shared with other work",
            },
        )
    finally:
        from django.db import connections

        connections.close_all()
        drop()


if __name__ == "__main__":
    main()
