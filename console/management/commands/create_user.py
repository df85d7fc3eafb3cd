import getpass

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from console import actions
from recovery import roles


class Command(BaseCommand):
    help = "Create a console user with a role (operator, oncall, manager, admin), or change their role."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--role", required=True, help=f"one of {', '.join(roles.ROLES)}")
        parser.add_argument("--email", default="")
        parser.add_argument("--password", help="default: ask on the terminal")

    def handle(self, *args, username, role, email, password, **options):
        try:
            roles.check_role(role)
        except roles.UnknownRole as exc:
            raise CommandError(str(exc)) from None
        exists = get_user_model().objects.filter(username=username).exists()
        if password is None and not exists:
            password = getpass.getpass(f"password for {username}: ")
        user = actions.set_user_role(
            username, role, email=email, password=password, actor=f"manage.py ({getpass.getuser()})"
        )
        self.stdout.write(f"{user.username}: {role}")
