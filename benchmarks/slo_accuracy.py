"""SLO accuracy: the console's burn rates against the same rules evaluated by promtool on the same requests.

One model and tier's traffic, minute by minute for a few hours (a steady error rate, then an incident that sheds and
fails a share of the requests), goes two ways: as request outcomes into the console's rollups (the stream consumer's
path, recovery.actions.streams.store_outcomes), whose burn rates /slo/ shows (console.readmodels.slo); and as the
gateway's `lifeline_gateway_requests_total` counters sampled every minute into promtool, which evaluates
prometheus/slo.yml's error ratios over 5 m, 30 m, 1 h and 2 h. Both divide by the objective's error budget. Printed:
each window's two burn rates and their difference (measured: the two pipelines run on the same generated requests).

    python -m benchmarks.slo_accuracy [--minutes 180]

It uses a SQLite file of its own and promtool from harness/promtool.py (Debian's package, downloaded once).
"""

import argparse
import datetime as dt
import os
import random
import re
import sys
import tempfile
from pathlib import Path

from benchmarks.common import BASE_DIR, save

MODEL, TIER, TENANT = "Qwen3-32B", "premium", "acme"
WINDOWS = ("5m", "30m", "1h", "2h")
CODES = {"ok": 200, "error": 502, "shed": 429}


def traffic(minutes: int, seed: int) -> list[dict[str, int]]:
    """Requests per minute by status: about 200 a minute, 0.05% failing, and for the last 40 minutes an incident in
    which 1–8% fail or are shed."""
    rng = random.Random(seed)
    per_minute = []
    for m in range(minutes):
        total = rng.randint(150, 250)
        bad = rng.uniform(0.01, 0.08) if m >= minutes - 40 else 0.0005
        errors = sum(rng.random() < bad / 2 for _ in range(total))
        shed = sum(rng.random() < bad / 2 for _ in range(total - errors))
        per_minute.append({"ok": total - errors - shed, "error": errors, "shed": shed})
    return per_minute


def console_burn_rates(per_minute: list[dict[str, int]], end: dt.datetime) -> dict[str, float]:
    """Store each minute's requests as the gateways report them, and read the burn rates the console shows at `end`."""
    from console.readmodels import slo as slo_model
    from recovery.actions import streams
    from recovery.models import SloObjective

    start = end - dt.timedelta(minutes=len(per_minute))
    n = 0
    for m, counts in enumerate(per_minute):
        items = []
        for status, count in counts.items():
            for i in range(count):
                n += 1
                finished = start + dt.timedelta(minutes=m, seconds=60 * (i + 0.5) / count)
                items.append(
                    (
                        "gw-1",
                        {
                            "request_id": f"acc-{n}",
                            "tenant": TENANT,
                            "tier": TIER,
                            "model": MODEL,
                            "status": "rejected" if status == "shed" else status,
                            "http_status": CODES[status],
                            "degradation_level": 2 if status == "shed" else 0,
                            "ttft_ms": 100.0 if status == "ok" else None,
                            "tpot_ms": 20.0 if status == "ok" else None,
                            "e2e_ms": 0.0,
                            "started_at": finished.timestamp(),
                        },
                    )
                )
        streams.store_outcomes(items)
    objective = SloObjective.objects.get(model_key=MODEL, tier=TIER, tenant="")
    status = slo_model.objective_status(objective, now=end)
    availability = next(i for i in status["indicators"] if i["indicator"] == "availability")
    return {w: availability["burn_rates"][w] for w in WINDOWS}, objective.availability_target / 100


def promtool_burn_rates(per_minute: list[dict[str, int]], target: float, workdir: Path) -> dict[str, float]:
    """The error ratios of prometheus/slo.yml at the end of the series, over the error budget, read from promtool."""
    import yaml

    from harness import promtool

    series = []
    for status in CODES:
        values, running = ["0"], 0
        for counts in per_minute:
            running += counts[status]
            values.append(str(running))
        labels = f'status="{status}", code="{CODES[status]}", model="{MODEL}", tier="{TIER}"'
        series.append({"series": f"lifeline_gateway_requests_total{{{labels}}}", "values": " ".join(values)})
    (workdir / "slo.yml").write_text((BASE_DIR / "prometheus" / "slo.yml").read_text())
    (workdir / "objectives.yml").write_text((BASE_DIR / "prometheus" / "objectives.yml").read_text())
    # Expect -1 of every ratio: promtool then prints what it got, which is the figure wanted.
    tests = [
        {
            "interval": "1m",
            "input_series": series,
            "promql_expr_test": [
                {
                    "expr": f"sum(model_tier:lifeline_gateway_request_errors:ratio_rate{w})",
                    "eval_time": f"{len(per_minute)}m",
                    "exp_samples": [{"labels": "{}", "value": -1}],
                }
                for w in WINDOWS
            ],
        }
    ]
    (workdir / "accuracy_test.yml").write_text(
        yaml.safe_dump({"rule_files": ["objectives.yml", "slo.yml"], "evaluation_interval": "1m", "tests": tests})
    )
    result = promtool.run("test", "rules", "accuracy_test.yml", cwd=workdir)
    output = result.stdout + result.stderr
    got = re.findall(r"ratio_rate(\w+)\)\", time: .*?\n\s+exp: .*?\n\s+got: \{\} ([0-9.eE+-]+)", output)
    ratios = {window: float(value) for window, value in got}
    assert set(ratios) == set(WINDOWS), output
    return {w: ratios[w] / (1 - target) for w in WINDOWS}


def compare(minutes: int, seed: int, workdir: Path) -> dict:
    end = dt.datetime.now(dt.UTC).replace(second=0, microsecond=0)
    per_minute = traffic(minutes, seed)
    console, target = console_burn_rates(per_minute, end)
    prom = promtool_burn_rates(per_minute, target, workdir)
    return {
        "requests": sum(sum(c.values()) for c in per_minute),
        "target": target,
        "windows": {
            w: {"console": console[w], "promtool": prom[w], "difference": console[w] - prom[w]} for w in WINDOWS
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=int, default=180)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="slo-accuracy-"))
    os.environ["DATABASE_URL"] = f"sqlite:///{workdir}/bench.sqlite3"
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
    sys.path.insert(0, str(BASE_DIR))
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    figures = compare(args.minutes, args.seed, workdir)
    worst = max(abs(f["difference"]) for f in figures["windows"].values())
    for window, f in figures["windows"].items():
        print(
            f"burn rate over {window}: console {f['console']:.6f}×, promtool {f['promtool']:.6f}×, "
            f"difference {f['difference']:+.2e}",
            file=sys.stderr,
        )
    print(f"{figures['requests']:,} requests; largest difference {worst:.2e}", file=sys.stderr)
    save("slo_accuracy", {**figures, "minutes": args.minutes, "largest_difference": worst, "note": "measured"})


if __name__ == "__main__":
    main()
