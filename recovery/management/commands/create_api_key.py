from django.core.management.base import BaseCommand, CommandError

from recovery import actions
from recovery.choices import Tier


class Command(BaseCommand):
    help = "Create a gateway API key for a tenant and print it (it is shown only once)."

    def add_arguments(self, parser):
        parser.add_argument("--tenant", required=True)
        parser.add_argument("--tier", default=Tier.STANDARD, help=f"one of {', '.join(Tier.values)}")
        parser.add_argument("--label", default="")

    def handle(self, *args, tenant, tier, label, **options):
        if tier not in Tier.values:
            raise CommandError(f"unknown tier {tier!r}: expected one of {', '.join(Tier.values)}")
        if not tenant.strip():
            raise CommandError("--tenant must not be empty")
        _, secret = actions.create_api_key(tenant.strip(), tier, label)
        self.stdout.write(secret)
