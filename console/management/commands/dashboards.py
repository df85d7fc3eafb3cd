from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from console import dashboards


class Command(BaseCommand):
    help = (
        "Write Lifeline's Grafana dashboards (console/dashboards.py, grafanalib) as provisioning JSON into "
        "prometheus/grafana/dashboards/, or with --check say which of the files there are not what the code makes."
    )

    def add_arguments(self, parser):
        parser.add_argument("--output", type=Path, default=dashboards.FOLDER, help="the folder to write them to")
        parser.add_argument("--check", action="store_true", help="change nothing; fail if a file is out of date")

    def handle(self, *args, output: Path, check: bool, **options):
        made = dashboards.rendered()
        if check:
            current = {n: (output / n).read_text() for n in made if (output / n).exists()}
            stale = sorted(n for n, text in made.items() if current.get(n) != text)
            if stale:
                raise CommandError(
                    f"{', '.join(stale)} in {output} are not what console/dashboards.py makes: "
                    "run `python manage.py dashboards` and commit the files"
                )
            self.stdout.write(f"{len(made)} dashboards in {output} are current")
            return
        output.mkdir(parents=True, exist_ok=True)
        for name, text in made.items():
            (output / name).write_text(text)
        self.stdout.write(f"wrote {len(made)} dashboards to {output}")
