from pathlib import Path

from django.core.management.base import BaseCommand

from recovery.models import SloObjective
from recovery.policy import slo_rules


class Command(BaseCommand):
    help = (
        "Write Prometheus' objectives rule file (prometheus/objectives.yml) from the console's objectives, so the "
        "burn-rate alerts in prometheus/slo.yml page on the targets an admin set. Per-tenant objectives are the "
        "console's alone: the gateways' metrics carry no tenant label."
    )

    def add_arguments(self, parser):
        parser.add_argument("--output", help="a file to write (default: standard output)")

    def handle(self, *args, output=None, **options):
        objectives = [
            slo_rules.Objective(
                o.model_key,
                o.tier,
                o.availability_target,
                o.ttft_threshold_ms,
                o.ttft_percentile,
                o.tpot_threshold_ms,
                o.tpot_percentile,
            )
            for o in SloObjective.objects.filter(tenant="")
        ]
        text = slo_rules.objectives_file(objectives)
        if output:
            Path(output).write_text(text)
            self.stderr.write(f"wrote {len(objectives)} objectives to {output}")
        else:
            self.stdout.write(text, ending="")
