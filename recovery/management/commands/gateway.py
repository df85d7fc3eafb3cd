from aiohttp import web
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from recovery.gateway.app import GatewayConfig, build_app


class Command(BaseCommand):
    help = "Run the gateway: Lifeline's OpenAI-compatible front door."

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8100)

    def handle(self, *args, host, port, **options):
        if not settings.REDIS_URL:
            raise CommandError("REDIS_URL is not set: the gateway reads its routing table from Redis (e.g. REDIS_URL=redis://127.0.0.1:6379/0).")
        app = build_app(GatewayConfig(redis_url=settings.REDIS_URL, namespace=settings.LIFELINE_NAMESPACE))
        self.stdout.write(f"gateway listening on http://{host}:{port}/v1")
        web.run_app(app, host=host, port=port, print=None, access_log=None, handler_cancellation=True)
