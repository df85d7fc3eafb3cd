import os

from aiohttp import web
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from recovery.gateway.app import GatewayConfig, build_app


class Command(BaseCommand):
    help = "Run the gateway: Lifeline's OpenAI-compatible front door."

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8100)
        parser.add_argument("--name", default="", help="this gateway's name in reports (default: host-pid)")
        parser.add_argument(
            "--drain-timeout",
            type=float,
            default=30.0,
            help="on SIGTERM, seconds to let requests in flight finish before closing their streams",
        )

    def handle(self, *args, host, port, name, drain_timeout, **options):
        if not settings.REDIS_URL:
            raise CommandError(
                "REDIS_URL is not set: the gateway reads its routing table from Redis (e.g. REDIS_URL=redis://127.0.0.1:6379/0)."
            )
        agent_token = os.environ.get("LIFELINE_AGENT_TOKEN")
        if not agent_token:
            self.stderr.write(
                "LIFELINE_AGENT_TOKEN is not set: nodes will refuse checkpoint holders and resumes, "
                "so failures re-prefill."
            )
        config = GatewayConfig(
            redis_url=settings.REDIS_URL, namespace=settings.LIFELINE_NAMESPACE, name=name, agent_token=agent_token
        )
        app = build_app(config)
        self.stdout.write(f"gateway {config.gateway_name} listening on http://{host}:{port}/v1")
        # On SIGTERM aiohttp stops accepting, then lets the handlers in flight run up to shutdown_timeout.
        web.run_app(
            app,
            host=host,
            port=port,
            print=None,
            access_log=None,
            handler_cancellation=True,
            shutdown_timeout=drain_timeout,
        )
