"""SLO roll-up throughput: request outcomes per second one worker process rolls into per-minute rollups.

The gateways report ~5,000 requests/s at the goal; the Celery worker must store them (recovery.actions.streams,
`store_outcomes`) and roll them up (recovery.actions.slo, `roll_up`) at least that fast. This stores N generated
outcomes (10 models × 3 tiers × 5 tenants, spread over 30 minutes, 2% of them arriving after their minute was
rolled) into a scratch database of their own, times both steps in this one process, and checks the rollups hold
exactly the outcomes counted.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/lifeline python -m benchmarks.slo_rollup [--outcomes 100000]

With a PostgreSQL DATABASE_URL it creates and drops a database of its own next to it; otherwise a SQLite file.
"""

import argparse
import datetime as dt
import os
import random
import secrets
import sys
import tempfile
import time

from benchmarks.common import BASE_DIR, save

GOAL_PER_S = 5000


def _scratch_database() -> tuple[str, callable]:
    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith(("postgres://", "postgresql://")):
        path = os.path.join(tempfile.mkdtemp(prefix="slo-bench-"), "bench.sqlite3")
        return f"sqlite:///{path}", lambda: None
    import psycopg
    from psycopg import sql

    base, name = url.rsplit("/", 1)[0], f"lifeline_bench_slo_{secrets.token_hex(4)}"
    admin = base + "/postgres"
    with psycopg.connect(admin, autocommit=True) as connection:
        connection.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))

    def drop():
        with psycopg.connect(admin, autocommit=True) as connection:
            connection.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))

    return f"{base}/{name}", drop


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

    url, drop = _scratch_database()
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

        stored_s = rolled_s = rolled_cpu_s = 0.0
        for lot in (on_time, late):
            for first in range(0, len(lot), 2000):  # the stream consumer reads 2,000 entries at a time
                t = time.perf_counter()
                streams.store_outcomes(lot[first : first + 2000])
                stored_s += time.perf_counter() - t
            t, cpu = time.perf_counter(), time.process_time()
            slo.roll_up(batch_size=args.batch, max_batches=10**6)
            rolled_s += time.perf_counter() - t
            rolled_cpu_s += time.process_time() - cpu

        counted = SloRollup.objects.aggregate(valid=Sum("valid"), errors=Sum("client_errors"), gone=Sum("client_gone"))
        total = sum(counted.values())
        assert total == args.outcomes, f"rollups hold {total} outcomes of {args.outcomes}"
        assert not RequestOutcome.objects.filter(rolled_up=False).exists()
        rollup_rate = args.outcomes / rolled_s
        both_rate = args.outcomes / (stored_s + rolled_s)
        print(
            f"{connection.vendor}: rolled up {args.outcomes:,} outcomes in {rolled_s:.2f} s = {rollup_rate:,.0f}/s "
            f"(goal {GOAL_PER_S:,}/s: {rollup_rate / GOAL_PER_S:.1f}×; the worker's own CPU {rolled_cpu_s:.2f} s, load "
            f"average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores); stored them in {stored_s:.2f} s; "
            f"store + roll-up {both_rate:,.0f}/s ({both_rate / GOAL_PER_S:.1f}× the goal) in one process",
            file=sys.stderr,
        )
        save(
            "slo_rollup",
            {
                "database": connection.vendor,
                "outcomes": args.outcomes,
                "late_outcomes": len(late),
                "batch": args.batch,
                "rollup_rows": SloRollup.objects.count(),
                "rollup_s": round(rolled_s, 3),
                "rollup_per_s": round(rollup_rate),
                "rollup_worker_cpu_s": round(rolled_cpu_s, 3),
                "load_average_1m": round(os.getloadavg()[0], 2),
                "store_s": round(stored_s, 3),
                "store_and_rollup_per_s": round(both_rate),
                "goal_per_s": GOAL_PER_S,
                "rollup_vs_goal": round(rollup_rate / GOAL_PER_S, 2),
                "store_and_rollup_vs_goal": round(both_rate / GOAL_PER_S, 2),
                "note": "one process, as one Celery worker runs both steps; the machine is shared with other work",
            },
        )
    finally:
        from django.db import connections

        connections.close_all()
        drop()


if __name__ == "__main__":
    main()
