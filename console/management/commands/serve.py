"""`python manage.py serve --role ROLE`: run one Lifeline process, as containers and hosts do.

The role comes from --role or LIFELINE_ROLE. The process replaces this one
(exec), so signals from the container runtime reach it directly.
"""

import os
import sys

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from console import webpool

ROLES = ("web", "worker", "beat", "gateway", "node")


class Command(BaseCommand):
    help = "Run one Lifeline process: web, worker, beat, gateway or node (from --role or LIFELINE_ROLE)."

    def add_arguments(self, parser):
        parser.add_argument("--role", default=os.environ.get("LIFELINE_ROLE"))
        parser.add_argument("--host", default=os.environ.get("LIFELINE_BIND_HOST", "0.0.0.0"))
        parser.add_argument("--port", type=int, default=None, help="default: 8000 for web, 8100 for gateway")
        parser.add_argument("--no-migrate", action="store_true", help="web: skip `migrate` before starting")
        parser.add_argument(
            "--processes",
            type=int,
            default=int(os.environ.get("LIFELINE_WEB_PROCESSES", "1")),
            help="web: daphne processes sharing the port (one keeps about 256 nodes beating; default 1)",
        )
        parser.add_argument("extra", nargs="*", help="more arguments for the process (node: workers.node options)")

    def handle(self, *args, role, host, port, no_migrate, processes, extra, **options):
        if not role:
            raise CommandError(f"no role: set LIFELINE_ROLE (or --role) to one of {', '.join(ROLES)}")
        if role not in ROLES:
            raise CommandError(f"LIFELINE_ROLE={role!r} is not a role: expected one of {', '.join(ROLES)}")
        if role != "node" and not settings.REDIS_URL:
            raise CommandError(
                f"REDIS_URL is not set: the {role} process needs Redis (e.g. REDIS_URL=redis://redis:6379/0)"
            )
        python = sys.executable
        if role == "web":
            if not no_migrate:
                from django.core.management import call_command

                call_command("migrate", interactive=False, verbosity=1)
            argv = [python, "-m", "daphne", "-b", host, "-p", str(port or 8000), "-v", "1", "console.asgi:application"]
            if processes < 1:
                raise CommandError(f"--processes {processes}: give 1 or more web processes")
            if processes > 1:
                try:
                    sock = webpool.listen(host, port or 8000)
                except (ValueError, OSError) as exc:
                    raise CommandError(str(exc)) from None
                self.stdout.write(f"lifeline web: {processes} processes on {host}:{port or 8000}")
                self.stdout.flush()

                def daphne_on(fd: int) -> list[str]:
                    return [python, "-m", "daphne", "--fd", str(fd), "-v", "1", "console.asgi:application", *extra]

                sys.exit(webpool.supervise(daphne_on, processes, sock))
        elif role == "worker":
            argv = [
                python,
                "-m",
                "celery",
                "-A",
                "console",
                "worker",
                "-l",
                "INFO",
                "--without-gossip",
                "--without-mingle",
            ]
        elif role == "beat":
            argv = [python, "-m", "celery", "-A", "console", "beat", "-l", "INFO", "--pidfile="]
        elif role == "gateway":
            argv = [python, "manage.py", "gateway", "--host", host, "--port", str(port or 8100)]
        else:
            # A node reads LIFELINE_NODE_* (name, rack, model, GPU, advertised host) from its environment.
            argv = [python, "-m", "workers.node", *(["--port", str(port)] if port else [])]
        argv += extra
        self.stdout.write(f"lifeline {role}: {' '.join(argv)}")
        self.stdout.flush()
        os.execv(python, argv)
