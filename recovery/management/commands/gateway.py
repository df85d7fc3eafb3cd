import asyncio
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
        parser.add_argument(
            "--reuse-port",
            action="store_true",
            help="share the port with other gateway processes on this host (SO_REUSEPORT: the kernel spreads the "
            "connections); run one per core",
        )

    def handle(self, *args, host, port, name, drain_timeout, reuse_port, **options):
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
        loop = _event_loop(os.environ.get("LIFELINE_GATEWAY_LOOP", "uvloop"))
        self.stdout.write(f"gateway {config.gateway_name} listening on http://{host}:{port}/v1 ({loop})")
        # On SIGTERM aiohttp stops accepting, then lets the handlers in flight run up to shutdown_timeout.
        web.run_app(
            app,
            host=host,
            port=port,
            print=None,
            access_log=None,
            handler_cancellation=True,
            shutdown_timeout=drain_timeout,
            reuse_port=reuse_port or None,
        )


def _event_loop(wanted: str) -> str:
    """uvloop where it is installed (it relays a token in less CPU than asyncio's own loop: benchmarks/gateway_peers),
    asyncio's otherwise or when LIFELINE_GATEWAY_LOOP=asyncio. Returns the one in use."""
    if wanted not in ("uvloop", "asyncio"):
        raise CommandError(f"LIFELINE_GATEWAY_LOOP={wanted!r}: expected uvloop or asyncio")
    if wanted == "uvloop":
        try:
            import uvloop
        except ImportError:
            return "asyncio (uvloop is not installed)"
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        return "uvloop"
    return "asyncio"
