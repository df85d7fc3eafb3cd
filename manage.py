#!/usr/bin/env python
"""Lifeline's command line: `python manage.py demo` starts the embedded default."""

import contextlib
import os
import sys


@contextlib.contextmanager
def embedded_database(command: list[str]):
    """Without DATABASE_URL the database is the embedded PostgreSQL in var/: `demo` starts it for the whole stack;
    any other command run while no stack is up starts it for its own run and stops it after."""
    if os.environ.get("DATABASE_URL") or command in ([], ["demo"], ["help"], ["--help"], ["-h"]):
        yield
        return
    from django.conf import settings

    from console import database
    from console.stack import StackError, Supervisor, start_embedded_postgres

    data = database.data_dir(settings.VAR_DIR)
    if database.running(data):
        yield
        return
    supervisor = Supervisor(settings.VAR_DIR / "log")
    try:
        start_embedded_postgres(supervisor, data)
    except (StackError, database.DatabaseError) as exc:
        sys.stderr.write(f"lifeline: {exc}\n")
        sys.exit(2)
    try:
        yield
    finally:
        supervisor.stop()


def main():
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
    from django.core.management import execute_from_command_line

    from console.env import ConfigError

    try:
        with embedded_database(sys.argv[1:2]):
            execute_from_command_line(sys.argv)
    except ConfigError as exc:
        # A wrong environment value: say which and what is expected, no traceback.
        sys.stderr.write(f"lifeline: configuration error: {exc}\n")
        sys.exit(2)


if __name__ == "__main__":
    main()
