"""The code-quality checks are tests: lint, format, types, Django's system checks and migrations.

Each runs its tool from the repository root with this interpreter (the virtualenv's), so the
versions are the ones the `test` extra installs, and fails with what the tool printed.
"""

import os
import subprocess
import sys

import pytest

from tests.helpers import BASE_DIR


def _passes(*args: str) -> None:
    """Run `python <args>`; fail with its output unless it exits 0."""
    # The Django commands read the settings from the environment the suite runs in
    # (tests/services.py sets the var directory and Redis): pass it through.
    result = subprocess.run(
        [sys.executable, *args], cwd=BASE_DIR, env=dict(os.environ), capture_output=True, text=True, timeout=300
    )
    if result.returncode != 0:
        pytest.fail(f"`python {' '.join(args)}` failed:\n{result.stdout}{result.stderr}", pytrace=False)


def test_ruff_finds_nothing():
    _passes("-m", "ruff", "check", ".")


def test_the_code_is_formatted():
    _passes("-m", "ruff", "format", "--check", ".")


def test_mypy_finds_no_type_errors():
    _passes("-m", "mypy")  # what and how to check: [tool.mypy] in pyproject.toml


def test_django_system_checks_pass():
    _passes("manage.py", "check")


def test_the_migrations_match_the_models():
    _passes("manage.py", "makemigrations", "--check", "--dry-run")
