"""The tree shows the architecture: workers/ and recovery/policy/ import no Django."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import BASE_DIR

DJANGO_FREE = ["workers", "recovery/policy", "recovery/gateway", "recovery/keys.py"]
FORBIDDEN = ("django", "channels", "celery", "console", "recovery.models", "recovery.actions", "recovery.hot")


def _python_files(relative: str) -> list[Path]:
    path = BASE_DIR / relative
    return [path] if path.is_file() else sorted(path.rglob("*.py"))


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


@pytest.mark.parametrize("path", [p for rel in DJANGO_FREE for p in _python_files(rel)], ids=lambda p: str(p.relative_to(BASE_DIR)))
def test_module_imports_no_django(path):
    bad = [name for name in _imports(path) if name.split(".")[0] in ("django", "channels", "celery", "console") or name.startswith(FORBIDDEN)]
    assert not bad, f"{path.relative_to(BASE_DIR)} imports {bad}"


def test_workers_never_import_the_control_plane():
    for path in _python_files("workers"):
        assert not [n for n in _imports(path) if n.split(".")[0] == "recovery"], path


def test_importing_the_node_side_loads_no_django():
    modules = [str(p.relative_to(BASE_DIR).with_suffix("")).replace("/", ".") for rel in ("workers", "recovery/policy") for p in _python_files(rel)]
    modules = [m.removesuffix(".__init__") for m in modules]
    code = "import sys\n" + "".join(f"import {m}\n" for m in modules) + "loaded = [m for m in sys.modules if m.split('.')[0] in ('django', 'channels', 'celery')]\nprint(loaded)\nsys.exit(1 if loaded else 0)"
    result = subprocess.run([sys.executable, "-c", code], cwd=BASE_DIR, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stdout + result.stderr
