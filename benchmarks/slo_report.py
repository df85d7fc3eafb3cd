"""SLA report speed: a 30-day report over 10 models × 3 tiers × 5 tenants of per-minute rollups, as a manager opens it.

Fills a scratch database of its own with one rollup per minute and scope for the report's 30 days and the 30 before
them (the report compares the two), 2 × 30 × 1,440 × 150 = 12,960,000 rows by default, bulk-inserted in SQL from a
few dozen minute templates counted by recovery.policy.slo (so every row is a consistent rollup: its histograms sum to
its valid counts), with their per-day sums and coverage as the roll-up keeps them beside the minutes; adds incidents
and degradation changes; then times the page (GET /reports/: the read model and
the template, through the whole view), the read model alone, the same page per tenant, and the PDF
(GET /api/reports?format=pdf), `--runs` times each, the first one cold.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/lifeline python -m benchmarks.slo_report [--days 30] [--runs 2]

It needs PostgreSQL: it creates and drops a database next to the one DATABASE_URL names.
"""

import argparse
import datetime as dt
import os
import random
import statistics
import sys
import time

from benchmarks.common import BASE_DIR, save, scratch_database

GOAL_PAGE_S = 1.0
GOAL_PDF_S = 5.0
POSTGRES_ONLY = "benchmarks.slo_report needs DATABASE_URL=postgres://…: the report's speed is measured on PostgreSQL"
MODELS = [f"model-{i}" for i in range(10)]
TIERS = ["premium", "standard", "best_effort"]
TENANTS = [f"tenant-{i}" for i in range(5)]
TEMPLATES = 64


def _templates(rng: random.Random) -> list:
    """Minutes of 10 to 40 requests each, counted as the roll-up counts them."""
    from recovery.policy import slo as slo_policy

    targets = slo_policy.Targets(2000.0, 100.0)
    minutes = []
    for _ in range(TEMPLATES):
        minute = slo_policy.MinuteRollup()
        for _ in range(rng.randint(10, 40)):
            status = rng.choices(["ok", "error", "shed", "client_gone"], [0.97, 0.01, 0.01, 0.01])[0]
            served = status != "shed"
            minute.add(
                status,
                {"ok": 200, "error": 502, "shed": 429, "client_gone": 499}[status],
                rng.lognormvariate(6.0, 0.6) if served else None,
                rng.lognormvariate(3.3, 0.4) if served else None,
                targets,
                level=2 if status == "shed" else 0,
                migrated=rng.random() < 0.005,
                completion_tokens=200,
            )
        minutes.append(minute)
    return minutes


def _fill(start: dt.datetime, minutes: int, rng: random.Random) -> int:
    """One rollup per minute and scope from `start` on, inserted by PostgreSQL from the templates."""
    import json

    from django.db import connection

    from recovery.policy.slo import MinuteRollup

    counters = list(MinuteRollup.COUNTERS)
    columns = [*counters, "shed_by_level", "ttft_hist", "tpot_hist"]
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE TEMPORARY TABLE template (v integer, "
            + ", ".join(f"{c} bigint" for c in counters)
            + ", shed_by_level jsonb, ttft_hist jsonb, tpot_hist jsonb)"
        )
        templates = _templates(rng)
        for v, minute in enumerate(templates):
            values = [getattr(minute, c) for c in counters]
            hists = [json.dumps(minute.shed_by_level), json.dumps(minute.ttft_hist), json.dumps(minute.tpot_hist)]
            cursor.execute(
                f"INSERT INTO template VALUES ({', '.join(['%s'] * (len(values) + 4))})", [v, *values, *hists]
            )
        scopes = [(m, t, n) for m in MODELS for t in TIERS for n in TENANTS]
        cursor.execute(
            "CREATE TEMPORARY TABLE scope (s integer, model_key text, tier text, tenant text);"
            + "INSERT INTO scope VALUES "
            + ", ".join(f"({i}, '{m}', '{t}', '{n}')" for i, (m, t, n) in enumerate(scopes))
        )
        cursor.execute(
            f"INSERT INTO recovery_slorollup (minute, model_key, tier, tenant, {', '.join(columns)}) "
            f"SELECT %s::timestamptz + m * interval '1 minute', scope.model_key, scope.tier, scope.tenant, "
            f"{', '.join('template.' + c for c in columns)} "
            f"FROM scope CROSS JOIN generate_series(0, %s) AS m "
            f"JOIN template ON template.v = (m * 7 + scope.s * 13) %% {TEMPLATES}",
            [start, minutes - 1],
        )
        inserted = cursor.rowcount
        cursor.execute("DROP TABLE template; DROP TABLE scope")
    _fill_days(start, minutes, scopes, templates)
    return inserted


def _fill_days(start: dt.datetime, minutes: int, scopes: list[tuple], templates: list) -> None:
    """The per-day rollups and coverage of those minutes, as recovery.actions.slo keeps them when it stores minutes:
    each day's sum is its templates' counts, each template times the minutes that use it."""
    from recovery.models import SloDayCoverage, SloDayRollup
    from recovery.policy.slo import MinuteRollup

    rows, coverage = [], {}
    sizes = (("ttft_hist", len(templates[0].ttft_hist)), ("tpot_hist", len(templates[0].tpot_hist)))
    for s, (model_key, tier, tenant) in enumerate(scopes):
        uses: dict[dt.date, list[int]] = {}
        for m in range(minutes):
            day = (start + dt.timedelta(minutes=m)).date()
            uses.setdefault(day, [0] * TEMPLATES)[(m * 7 + s * 13) % TEMPLATES] += 1
        for day, counts in uses.items():
            fields = {c: sum(n * getattr(templates[v], c) for v, n in enumerate(counts)) for c in MinuteRollup.COUNTERS}
            hists = {
                kind: [sum(n * getattr(templates[v], kind)[i] for v, n in enumerate(counts)) for i in range(size)]
                for kind, size in sizes
            }
            shed: dict[str, int] = {}
            for v, n in enumerate(counts):
                for level, k in templates[v].shed_by_level.items():
                    shed[level] = shed.get(level, 0) + n * k
            hists["shed_by_level"] = shed
            rows.append(SloDayRollup(model_key=model_key, tier=tier, tenant=tenant, day=day, **fields, **hists))
            coverage[day] = sum(counts)
    SloDayRollup.objects.bulk_create(rows, batch_size=1000)
    SloDayCoverage.objects.bulk_create([SloDayCoverage(day=day, minutes=n) for day, n in coverage.items()])


def _history(start: dt.datetime, end: dt.datetime, rng: random.Random) -> None:
    """Incidents with their first symptom and moved requests, and degradation changes, across the report's days."""
    from recovery.choices import EventKind, IncidentSeverity, IncidentStatus
    from recovery.models import Cluster, DegradationChange, Incident, IncidentEvent

    cluster = Cluster.default()
    span = (end - start).total_seconds()
    for i in range(20):
        opened = start + dt.timedelta(seconds=rng.uniform(0, span - 3600))
        incident = Incident.objects.create(
            cluster=cluster,
            title=f"node-{i:02d} failed",
            opened_at=opened,
            detected_at=opened + dt.timedelta(seconds=rng.uniform(1, 5)),
            recovered_at=opened + dt.timedelta(seconds=rng.uniform(20, 120)),
            capacity_restored_at=opened + dt.timedelta(seconds=rng.uniform(120, 900)),
            recovery_time_s=60.0,
            severity=rng.choice(list(IncidentSeverity.values)),
            status=IncidentStatus.CLOSED,
        )
        IncidentEvent.objects.bulk_create(
            [IncidentEvent(incident=incident, kind=EventKind.SYMPTOM, at=opened, source="bench", description="lost")]
            + [
                IncidentEvent(
                    incident=incident,
                    kind=EventKind.REQUEST_MOVED,
                    at=opened + dt.timedelta(seconds=3),
                    source="bench",
                    description="moved",
                    request_id=f"r-{i}-{j}",
                    details={"stall_ms": rng.uniform(50, 400)},
                )
                for j in range(30)
            ]
        )
    level = 0
    for at in sorted(start + dt.timedelta(seconds=rng.uniform(0, span)) for _ in range(60)):
        new = rng.choice([n for n in range(4) if n != level])
        DegradationChange.objects.create(cluster=cluster, at=at, old_level=level, new_level=new, cause="bench")
        level = new


def _timed(fn, runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--days", type=int, default=30, help="the report's length; the days before it are filled too")
    parser.add_argument("--runs", type=int, default=2, help="timed runs of each, the first one cold")
    args = parser.parse_args()

    url, drop = scratch_database("report", POSTGRES_ONLY)
    os.environ["DATABASE_URL"] = url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
    sys.path.insert(0, str(BASE_DIR))
    try:
        import django

        django.setup()
        from django.core.management import call_command
        from django.db import connection
        from django.test import Client
        from django.test.utils import setup_test_environment

        from console.actions import set_user_role
        from console.readmodels import reports

        setup_test_environment()  # the test client's host name; e-mail to memory
        call_command("migrate", verbosity=0)
        rng = random.Random(12)
        today = dt.datetime.now(dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0)
        start = today - dt.timedelta(days=args.days)
        t = time.perf_counter()
        rows = _fill(start - dt.timedelta(days=args.days), 2 * args.days * 1440, rng)
        _history(start, today, rng)
        with connection.cursor() as cursor:
            cursor.execute("VACUUM ANALYZE recovery_slorollup")  # as autovacuum leaves a table that is only appended to
            cursor.execute("SELECT pg_total_relation_size('recovery_slorollup')")
            table_bytes = cursor.fetchone()[0]
        filled_s = time.perf_counter() - t
        size = f"{table_bytes / 2**30:.1f} GiB with indexes"
        print(f"filled {rows:,} rollups ({size}) in {filled_s:.0f} s", file=sys.stderr)

        client = Client()
        client.force_login(set_user_role("manager", "manager"))
        last_day = (today - dt.timedelta(days=1)).date()
        query = {"period": "custom", "start": start.date().isoformat(), "end": last_day.isoformat()}
        period = reports.parse_period(query)
        assert period.seconds == args.days * 86400, period

        def page(**more):
            response = client.get("/reports/", {**query, **more})
            assert response.status_code == 200 and b"chart-budgets" in response.content, response.status_code

        def pdf():
            response = client.get("/api/reports", {**query, "format": "pdf"})
            assert response.status_code == 200 and response.content.startswith(b"%PDF")

        page_s = _timed(page, args.runs)
        model_s = _timed(lambda: reports.report(period), args.runs)
        tenant_s = _timed(lambda: page(tenant="1"), args.runs)
        pdf_s = _timed(pdf, args.runs)
        data = reports.report(period)
        page_median, pdf_median = statistics.median(page_s), statistics.median(pdf_s)
        print(
            f"{connection.vendor}, {rows:,} rollups ({args.days} days reported): page {page_median:.2f} s median "
            f"(first {page_s[0]:.2f} s; goal {GOAL_PAGE_S} s: {page_median / GOAL_PAGE_S:.1f}× it), of which the "
            f"read model {statistics.median(model_s):.2f} s; per tenant {statistics.median(tenant_s):.2f} s; PDF "
            f"{pdf_median:.2f} s (goal {GOAL_PDF_S} s: {pdf_median / GOAL_PDF_S:.2f}× it); load average "
            f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores",
            file=sys.stderr,
        )
        save(
            "slo_report",
            {
                "database": connection.vendor,
                "rollup_rows": rows,
                "rollup_rows_in_report": rows // 2,
                "scopes": len(MODELS) * len(TIERS) * len(TENANTS),
                "report_days": args.days,
                "table_gib": round(table_bytes / 2**30, 2),
                "fill_s": round(filled_s, 1),
                "requests_in_report": data["totals"]["requests"],
                "incidents_in_report": len(data["incidents"]),
                "page_s": [round(s, 3) for s in page_s],
                "page_median_s": round(page_median, 3),
                "read_model_s": [round(s, 3) for s in model_s],
                "page_per_tenant_s": [round(s, 3) for s in tenant_s],
                "pdf_s": [round(s, 3) for s in pdf_s],
                "pdf_median_s": round(pdf_median, 3),
                "goal_page_s": GOAL_PAGE_S,
                "goal_pdf_s": GOAL_PDF_S,
                "page_vs_goal": round(page_median / GOAL_PAGE_S, 2),
                "pdf_vs_goal": round(pdf_median / GOAL_PDF_S, 2),
                "load_average_1m": round(os.getloadavg()[0], 2),
                "runs": args.runs,
                "note": "measured, one process; the first run of each cold; the machine is shared with other work",
            },
        )
    finally:
        from django.db import connections

        connections.close_all()
        drop()


if __name__ == "__main__":
    main()
