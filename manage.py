#!/usr/bin/env python
"""Lifeline's command line: `python manage.py demo` starts the embedded default."""

import os
import sys


def main():
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
    from django.core.management import execute_from_command_line

    from console.env import ConfigError

    try:
        execute_from_command_line(sys.argv)
    except ConfigError as exc:
        # A wrong environment value: say which and what is expected, no traceback.
        sys.stderr.write(f"lifeline: configuration error: {exc}\n")
        sys.exit(2)


if __name__ == "__main__":
    main()
