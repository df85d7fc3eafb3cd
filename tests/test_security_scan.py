"""Static and dependency scans (issue 17, docs/security.md "Dependencies"): bandit over the project's code, each finding
fixed or justified below; pip-audit over the installed packages where its vulnerability database can be reached."""

import json
import shutil
import subprocess
import sys

import pytest

from tests.helpers import BASE_DIR

PACKAGES = ("console", "recovery", "workers")

# Bandit checks whose every finding here is justified (docs/security.md, "Static analysis").
JUSTIFIED_CHECKS = {
    "B101": "assert states an invariant of the policies and the simulator; Lifeline never runs under python -O",
    "B311": "random drives the simulator, the traffic generator and retry jitter, never a secret (secrets does)",
    "B404": "subprocess starts our own processes (the demo stack, benchmarks) with fixed argument lists",
    "B603": "subprocess starts our own processes with fixed argument lists, no shell, no user input",
    "B606": "os.exec* of our own server with fixed arguments (manage.py serve; a node switching model)",
}
# Findings justified where they are: (check, file) -> why.
JUSTIFIED_FINDINGS = {
    ("B310", "recovery/nodeclient.py"): "a node's address is checked to be http(s):// at registration (protocol)",
    ("B310", "recovery/canary.py"): "a node's address is checked to be http(s):// at registration (protocol)",
    ("B310", "recovery/actions/notify.py"): "the on-call webhook is a URLField set by an admin; a timeout bounds it",
    ("B310", "console/stack.py"): "the demo stack polls its own loopback URLs",
    ("B104", "workers/node.py"): "a node agent serves the cluster network; --host narrows it",
    ("B104", "console/management/commands/serve.py"): "the web and gateway serve behind a proxy; --host narrows it",
    ("B105", "console/models.py"): "'llt_' is the API tokens' public prefix, not a password",
    ("B105", "console/management/commands/demo.py"): "'admin' is the user name the demo's token acts as",
    ("B105", "workers/runtime.py"): "'lln.' is the per-node tokens' public prefix, not a password",
    ("B105", "workers/adapter.py"): "a comparison with the string 'True', not a password",
    ("B105", "recovery/gateway/relay.py"): "a comparison with the string 'True', not a password",
    ("B105", "recovery/canary.py"): "a comparison with the string 'True', not a password",
    ("B406", "console/exports.py"): "xml.sax.saxutils.escape escapes our own text for the PDF; nothing is parsed",
}


def test_bandit_finds_nothing_unjustified():
    if shutil.which("bandit", path=str(BASE_DIR / ".venv" / "bin")) is None and not _importable("bandit"):
        pytest.skip("bandit is not installed: pip install -e '.[test]'")
    result = subprocess.run(
        [sys.executable, "-m", "bandit", "-r", *PACKAGES, "-f", "json", "-q", "-x", "*/migrations/*"],
        cwd=BASE_DIR,
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = json.loads(result.stdout)
    assert not report["errors"], report["errors"]
    unjustified = [
        f"{r['test_id']} {r['filename']}:{r['line_number']} {r['issue_text']}"
        for r in report["results"]
        if r["test_id"] not in JUSTIFIED_CHECKS and (r["test_id"], r["filename"]) not in JUSTIFIED_FINDINGS
    ]
    assert not unjustified, "fix these, or justify them here and in docs/security.md:\n" + "\n".join(unjustified)


def test_pip_audit_finds_no_known_vulnerability():
    if not _importable("pip_audit"):
        pytest.skip("pip-audit is not installed: pip install -e '.[test]'")
    result = subprocess.run(
        [sys.executable, "-m", "pip_audit", "--progress-spinner", "off", "--format", "json", "--skip-editable"],
        cwd=BASE_DIR,
        capture_output=True,
        text=True,
        timeout=300,
    )
    try:
        report = json.loads(result.stdout)
    except ValueError:
        # No JSON: it could not reach its vulnerability database (PyPI's JSON API or OSV), as on a machine offline.
        pytest.skip(f"pip-audit could not run its audit here (no network to its database?): {result.stderr[-400:]}")
    audited = [dep for dep in report["dependencies"] if "skip_reason" not in dep]
    if not audited:
        reason = report["dependencies"][0]["skip_reason"] if report["dependencies"] else "nothing to audit"
        pytest.skip(f"pip-audit could reach no vulnerability data for any package here (offline?): {reason}")
    vulnerable = [
        f"{dep['name']} {dep['version']}: {', '.join(v['id'] for v in dep['vulns'])}"
        for dep in report["dependencies"]
        if dep.get("vulns")
    ]
    assert not vulnerable, "upgrade these, or justify them in docs/security.md:\n" + "\n".join(vulnerable)


def _importable(module: str) -> bool:
    return subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True).returncode == 0
