from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from console.models import ApiToken
from recovery.actions import audit


class Command(BaseCommand):
    help = "Revoke a user's API token by its prefix (the first 12 characters, as `--list` shows them)."

    def add_arguments(self, parser):
        parser.add_argument("prefix", nargs="?")
        parser.add_argument("--list", action="store_true", help="list the tokens: prefix, user, label, last used")
        parser.add_argument("--reason", default="")

    def handle(self, *args, prefix, list, reason, **options):
        if list or not prefix:
            for row in ApiToken.objects.select_related("user").order_by("user__username", "-created_at"):
                used = f"{row.last_used_at:%Y-%m-%d %H:%M}" if row.last_used_at else "never"
                state = f"revoked {row.revoked_at:%Y-%m-%d %H:%M}" if row.revoked_at else "active"
                self.stdout.write(f"{row.prefix}  {row.user.get_username()}  {row.label!r}  used {used}  {state}")
            return
        rows = ApiToken.objects.filter(prefix=prefix[:12])
        if not rows.exists():
            raise CommandError(f"no token starts {prefix[:12]!r}: `manage.py revoke_token --list` lists them")
        revoked = rows.filter(revoked_at__isnull=True).update(revoked_at=timezone.now())
        for row in rows.select_related("user"):
            audit.record("system", "revoke_token", f"api_token:{row.prefix}", reason, user=row.user.get_username())
        self.stdout.write(f"{revoked} token(s) revoked" if revoked else "already revoked")
