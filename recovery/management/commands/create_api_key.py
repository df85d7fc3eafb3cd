import getpass

from django.core.management.base import BaseCommand, CommandError

from recovery.actions import keys
from recovery.choices import Tier


class Command(BaseCommand):
    help = "Create a gateway API key for a tenant and print it (it is shown only once)."

    def add_arguments(self, parser):
        parser.add_argument("--tenant", required=True)
        parser.add_argument("--tier", default=Tier.STANDARD, help=f"one of {', '.join(Tier.values)}")
        parser.add_argument("--label", default="")
        parser.add_argument(
            "--providers", default="", help="comma-separated: its requests run only on these providers' nodes"
        )
        parser.add_argument("--regions", default="", help="comma-separated: its requests run only in these regions")

    def handle(self, *args, tenant, tier, label, providers, regions, **options):
        try:
            _, secret = keys.create_api_key(
                tenant,
                tier,
                label,
                providers=providers,
                regions=regions,
                actor=f"manage.py ({getpass.getuser()})",
            )
        except keys.KeyRefused as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(secret)
