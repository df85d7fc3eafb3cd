from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from console.models import ApiToken
from recovery import roles


class Command(BaseCommand):
    help = "Print a new API token for USER. The token acts with that user's role."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--label", default="issued from the command line")

    def handle(self, *args, username, label, **options):
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise CommandError(
                f"no user {username!r}: create one with `python manage.py create_user {username} --role operator`"
            )
        if roles.role_of(user) is None:
            raise CommandError(
                f"user {username!r} has no Lifeline role, so a token would be refused: "
                f"give them one of {', '.join(roles.ROLES)} first"
            )
        _, token = ApiToken.issue(user, label)
        self.stdout.write(token)
