"""The tree shows the architecture: workers/ and recovery/policy/ import no Django."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import BASE_DIR

DJANGO_FREE = [
    "workers",
    "recovery/policy",
    "recovery/sim",
    "recovery/gateway",
    "recovery/keys.py",
    "recovery/protocol.py",
]
FORBIDDEN = ("django", "channels", "celery", "console", "recovery.models", "recovery.actions", "recovery.hot")


def _python_files(relative: str) -> list[Path]:
    path = BASE_DIR / relative
    return [path] if path.is_file() else sorted(path.rglob("*.py"))


def _imports(path: Path) -> list[str]:
    """Every module a file imports, function-local imports included; `from x import y` counts as x and x.y."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


@pytest.mark.parametrize(
    "path", [p for rel in DJANGO_FREE for p in _python_files(rel)], ids=lambda p: str(p.relative_to(BASE_DIR))
)
def test_module_imports_no_django(path):
    bad = [
        name
        for name in _imports(path)
        if name.split(".")[0] in ("django", "channels", "celery", "console") or name.startswith(FORBIDDEN)
    ]
    assert not bad, f"{path.relative_to(BASE_DIR)} imports {bad}"


def test_workers_never_import_the_control_plane():
    for path in _python_files("workers"):
        assert not [n for n in _imports(path) if n.split(".")[0] == "recovery"], path


def test_importing_the_node_side_loads_no_django():
    modules = [
        str(p.relative_to(BASE_DIR).with_suffix("")).replace("/", ".")
        for rel in ("workers", "recovery/policy")
        for p in _python_files(rel)
    ]
    modules = [m.removesuffix(".__init__") for m in modules]
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + "loaded = [m for m in sys.modules if m.split('.')[0] in ('django', 'channels', 'celery')]\n"
        + "print(loaded)\n"
        + "sys.exit(1 if loaded else 0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=BASE_DIR, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    "path", _python_files("recovery") + _python_files("workers"), ids=lambda p: str(p.relative_to(BASE_DIR))
)
def test_nothing_below_the_console_imports_it(path):
    """console → recovery → workers, one way: the control plane and the data plane never reach up into the console."""
    assert not [n for n in _imports(path) if n.split(".")[0] == "console"], (
        f"{path.relative_to(BASE_DIR)} imports the console"
    )


def test_the_actions_import_only_downward():
    """Each module of recovery/actions imports only the ones before it in ORDER: no loop, no arrow back up.

    What must follow a committed change elsewhere is a reaction (recovery.reactions), which may import
    them all; nothing in recovery/actions imports recovery.reactions or recovery.tasks."""
    from recovery.actions import ORDER

    found = sorted(p.stem for p in (BASE_DIR / "recovery/actions").glob("*.py") if p.stem != "__init__")
    assert sorted(ORDER) == found, "recovery/actions/__init__.py's ORDER must list every actions module"
    for position, module in enumerate(ORDER):
        imported = _imports(BASE_DIR / f"recovery/actions/{module}.py")
        actions = {n.split(".")[2] for n in imported if n.startswith("recovery.actions.") and n.split(".")[2] in ORDER}
        above = sorted(a for a in actions if ORDER.index(a) >= position)
        assert not above, f"recovery/actions/{module}.py imports {above}, which are not below it in ORDER"
        upward = [n for n in imported if n.startswith(("recovery.reactions", "recovery.tasks", "recovery.views"))]
        assert not upward, f"recovery/actions/{module}.py imports {upward}"


def test_tasks_are_enqueued_by_reference_and_every_scheduled_name_exists():
    """No `send_task("...")` with a string nothing checks; the beat schedule names only registered tasks."""
    from django.conf import settings

    from console.celery import app

    for path in _python_files("recovery") + _python_files("console"):
        assert "send_task(" not in path.read_text(), f"{path.relative_to(BASE_DIR)} enqueues a task by its name"
    app.loader.import_default_modules()
    missing = [entry["task"] for entry in settings.CELERY_BEAT_SCHEDULE.values() if entry["task"] not in app.tasks]
    assert not missing, f"scheduled but not registered: {missing}"


def _module_of(path: Path) -> str:
    parts = path.relative_to(BASE_DIR).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_two_modules_of_the_product_import_each_other():
    """Issue 44: a pair that imports each other (workers.engine and workers.openai_schema did, one of the two under
    TYPE_CHECKING) is one module in two files; the shared part belongs below both."""
    paths = [p for package in ("workers", "recovery", "console") for p in _python_files(package)]
    modules = {_module_of(p): p for p in paths if "migrations" not in p.parts}
    imported = {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}
    pairs = sorted({tuple(sorted((a, b))) for a, found in imported.items() for b in found if a in imported[b]})
    assert pairs == []
    assert imported["workers.engine"] and imported["workers.openai_schema"]  # the check reads imports at all
