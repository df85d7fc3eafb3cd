from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from workers.runtime import node_token


class Command(BaseCommand):
    help = (
        "Print the per-node token of NAME: start that node with LIFELINE_NODE_TOKEN set to it. It speaks only for "
        "NAME; it changes when LIFELINE_NODE_TOKEN_SECRET does (rotation: docs/security.md)."
    )

    def add_arguments(self, parser):
        parser.add_argument("name")

    def handle(self, *args, name, **options):
        if not settings.LIFELINE_NODE_TOKEN_SECRET:
            raise CommandError("LIFELINE_NODE_TOKEN_SECRET is not set: set it (32+ random characters) first")
        self.stdout.write(node_token(settings.LIFELINE_NODE_TOKEN_SECRET, name))
