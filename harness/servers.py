"""An outside server the tests run as a process of its own (Prometheus, Alertmanager): started, waited for until
its /-/ready answers, its log kept, stopped with SIGTERM."""

import signal
import subprocess
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from harness.processes import wait_for


@dataclass
class Server:
    name: str
    argv: list[str]
    url: str
    log_path: Path
    env: dict | None = None
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def start(self, timeout_s: float = 30) -> "Server":
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        wait_for(self.ready, timeout_s, 0.2, f"{self.name} ready")
        return self

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=5) as answer:
                return answer.status == 200
        except OSError:
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
