"""Real processes for the tests and the benchmarks: serving nodes, whole Lifeline stacks, and clients of them."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent


class NodeProcess:
    """A `python -m workers.node` process; its address comes from its first output line."""

    def __init__(self, name: str, *extra: str, env: dict | None = None, log_dir: Path | None = None):
        self.name = name
        start = [] if "--start" in extra else ["--start", "warm"]  # tests that watch a model load say so
        self.argv = [sys.executable, "-m", "workers.node", "--name", name, "--port", "0", *start, *extra]
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.log_dir = log_dir
        self.proc: subprocess.Popen | None = None
        self.address: str | None = None

    def start(self, timeout_s: float = 20) -> "NodeProcess":
        stderr = open(self.log_dir / f"{self.name}.log", "ab") if self.log_dir else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            self.argv, cwd=BASE_DIR, env=self.env, stdout=subprocess.PIPE, stderr=stderr, text=True
        )
        deadline = time.monotonic() + timeout_s
        line = self.proc.stdout.readline()
        if not line or time.monotonic() > deadline:
            raise RuntimeError(f"node {self.name} did not start (exit code {self.proc.poll()})")
        info = json.loads(line)
        self.address = info["address"]
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self, signum: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signum)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # a hung node cannot run its SIGTERM handler
                self.proc.kill()
                self.proc.wait(timeout=5)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)
        if self.proc and self.proc.stdout:
            self.proc.stdout.close()


def http_json(
    url: str, *, data=None, headers: dict | None = None, method: str | None = None, timeout: float = 10
) -> tuple[int, dict]:
    body = json.dumps(data).encode() if data is not None else None
    request = urllib.request.Request(
        url, data=body, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def wait_for(predicate, timeout_s: float, interval_s: float = 0.1, message: str = "condition"):
    """Poll `predicate` until it returns something truthy; return that, or fail after the timeout."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {message} (last: {last!r})")


@dataclass
class DemoStack:
    """`manage.py demo` run as a subprocess, with its own database and var dir."""

    var_dir: Path
    env: dict
    argv: list[str]
    proc: subprocess.Popen | None = None
    info: dict = field(default_factory=dict)
    gateway_url: str = ""  # the first gateway's, known before the stack is up (harness.processes.demo)

    def start(self, timeout_s: float = 120) -> "DemoStack":
        self.launch()
        info_file = self.var_dir / "demo.json"
        deadline = time.monotonic() + timeout_s
        while not info_file.exists() or info_file.stat().st_mtime_ns == self._info_before:
            if self.proc.poll() is not None:
                raise RuntimeError(f"demo exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"demo did not start in {timeout_s} s:\n{self.log()}")
            time.sleep(0.2)
        self.refresh()
        return self

    def launch(self) -> subprocess.Popen:
        """Start `manage.py demo` and return at once (start() waits for it to be up). A demo.json left by a
        previous run in the same var dir is not taken for this one's."""
        self.var_dir.mkdir(parents=True, exist_ok=True)
        info_file = self.var_dir / "demo.json"
        self._info_before = info_file.stat().st_mtime_ns if info_file.exists() else None
        self.output = open(self.var_dir / "demo.out", "ab")
        self.proc = subprocess.Popen(
            self.argv, cwd=BASE_DIR, env=self.env, stdout=self.output, stderr=subprocess.STDOUT, start_new_session=True
        )
        return self.proc

    def refresh(self) -> dict:
        self.info = json.loads((self.var_dir / "demo.json").read_text())
        return self.info

    def log(self) -> str:
        return (self.var_dir / "demo.out").read_text(errors="replace")[-4000:]

    def api(self, path: str) -> tuple[int, dict]:
        return self.call("GET", path)

    def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        """The console's API as its admin (demo.json's API token)."""
        base = self.info["urls"]["console"].rstrip("/")
        headers = {"Authorization": f"Bearer {self.info['api_token']}"}
        return http_json(base + path, data=body, method=method, headers=headers)

    def node(self, name: str) -> dict:
        status, body = self.api("/api/cluster")
        assert status == 200, body
        return next(n for n in body["nodes"] if n["name"] == name)

    def baseline(self) -> dict:
        """What put_back() returns the stack to: its settings and its nodes, as they are now."""
        status, settings = self.call("GET", "/api/settings")
        assert status == 200, settings
        status, cluster = self.api("/api/cluster")
        assert status == 200, cluster
        return {"settings": settings, "nodes": sorted(n["name"] for n in cluster["nodes"])}

    def put_back(self, baseline: dict, timeout_s: float = 120) -> None:
        """The stack as it was at `baseline` (a stack shared by several users, between two of them): every waiting
        drain withdrawn, every fault on its nodes cleared, each of them serving, healthy, at full weight with its
        breaker closed, no other node alive, no drain open, no incident of its nodes active, the degradation level 0
        at the console and the gateway, the cluster breaker closed, and its settings as they were. While it waits,
        canaries run every 5 s and breakers and levels wait 1 s, so an UNHEALTHY node returns through its half-open
        trial in seconds. Nodes and incidents that came and went stay, as history. Fails, saying what is not back,
        if the fleet is not whole within `timeout_s`."""
        reason = {"reason": "put back between two users of a shared stack"}
        quick = {"canary_interval_s": 5, "canary_retry_s": 0.5, "breaker_open_s": 1, "degradation_hold_s": 0}
        quick["drain_propose_again_s"] = 86400  # a withdrawn drain is not proposed again while the fleet returns
        status, answer = self.call("PATCH", "/api/settings", {**quick, **reason})
        assert status == 200, answer
        fault_token = {"Authorization": f"Bearer {self.info['fault_token']}"}
        for card in self.api("/api/cluster")[1]["nodes"]:
            if card["name"] in baseline["nodes"] and card["alive"]:
                try:
                    http_json(card["address"] + "/agent/faults", method="DELETE", headers=fault_token, timeout=5)
                except OSError:  # a node restarting: a new process has no fault
                    pass
        deadline = time.monotonic() + timeout_s
        while True:
            for drain in self.call("GET", "/api/drains")[1]["drains"]:  # those proposed while it waits too
                if drain["waiting"]:
                    self.call("POST", f"/api/drains/{drain['id']}/cancel", reason)
            if not (problems := self._not_back(baseline)):
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"the shared stack was not put back in {timeout_s} s: {'; '.join(problems)}")
            time.sleep(0.5)
        status, answer = self.call("PATCH", "/api/settings", {**baseline["settings"], **reason})
        assert status == 200, answer
        now = self.call("GET", "/api/settings")[1]
        now["models"] = {model: now["models"].get(model) for model in baseline["settings"]["models"]}
        assert {key: now[key] for key in baseline["settings"]} == baseline["settings"], answer

    def _not_back(self, baseline: dict) -> list[str]:
        """What keeps the fleet from being as it was at `baseline`, in words (empty when nothing does)."""
        nodes = {card["name"]: card for card in self.api("/api/cluster")[1]["nodes"]}
        problems = []
        for name in baseline["nodes"]:
            card = nodes.get(name) or {}
            if (card.get("state"), card.get("tone"), card.get("weight")) != ("serving", "ok", 1.0):
                got = {key: card.get(key) for key in ("state", "health", "breaker", "weight", "problems")}
                problems.append(f"{name} is not back: {got}")
        problems += [
            f"{name} is {card['state']}"
            for name, card in nodes.items()
            if card["alive"] and name not in baseline["nodes"]
        ]
        problems += [
            f"drain #{d['id']} of {d['node']} is {d['state']}"
            for d in self.call("GET", "/api/drains")[1]["drains"]
            if d["open"]
        ]
        for incident in self.api("/api/incidents")[1]["incidents"]:  # a failure now would join it, not open its own
            ours = not incident["nodes"] or set(incident["nodes"]) & set(baseline["nodes"])  # not a node gone for good
            if incident["status"] == "active" and ours:
                problems.append(f"incident #{incident['id']} ({incident['title']}) is active")
        degradation = self.call("GET", "/api/degradation")[1]
        level = degradation["level"]
        gateway = http_json(self.info["urls"]["gateway"].removesuffix("/v1") + "/healthz")[1]["degradation_level"]
        if (level, gateway) != (0, 0):
            problems.append(f"the degradation level is {level} (the gateway's {gateway})")
        if degradation["cluster_breaker_open"]:  # an admin's reset, with a reason: not something to undo here
            problems.append(f"the cluster breaker is open: {degradation['cluster_breaker_reason']}")
        return problems

    def stop(self, timeout_s: float = 30, signum: int = signal.SIGINT) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.output.close()
        return self.proc.returncode


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split()[2] != "Z"
    except OSError:
        return False


def processes_mentioning(text: str) -> list[int]:
    """Pids of live processes whose command line or environment mentions `text`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            blob = (entry / "cmdline").read_bytes() + (entry / "environ").read_bytes()
        except OSError:
            continue
        if text.encode() in blob and pid_alive(int(entry.name)):
            pids.append(int(entry.name))
    return pids


def chat_stream(
    base: str, key: str, model: str, prompt: str, on_token=None, *, error_ok: bool = False, **params
) -> tuple[str, list[str], str]:
    """A chat completion streamed through a gateway by the official OpenAI client: (text, SSE comments, the node
    that took it). `on_token(count, node)` runs after each token (to kill its node mid-stream, say); OpenAI clients
    skip SSE comments, so they are read here (a move is announced in one). An error event in the stream fails the
    caller unless `error_ok` (a test that means to end a stream in one). `params`: the request's other fields."""
    return _openai_stream(base, key, model, prompt, on_token, error_ok, True, params)


def completion_stream(
    base: str, key: str, model: str, prompt: str, on_token=None, *, error_ok: bool = False, **params
) -> tuple[str, list[str], str]:
    """chat_stream's completion: the same, with `prompt` as a completion's prompt."""
    return _openai_stream(base, key, model, prompt, on_token, error_ok, False, params)


def _openai_stream(base, key, model, prompt, on_token, error_ok, chat, params) -> tuple[str, list[str], str]:
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
    if chat:
        streaming = client.chat.completions.with_streaming_response.create(
            model=model, messages=[{"role": "user", "content": prompt}], stream=True, **params
        )
    else:
        streaming = client.completions.with_streaming_response.create(model=model, prompt=prompt, stream=True, **params)
    with streaming as response:
        node = response.headers["x-lifeline-node"]
        text, comments, count = [], [], 0
        for line in response.iter_lines():
            if line.startswith(":"):
                comments.append(line)
            elif line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert error_ok or "error" not in chunk, chunk
                choice = chunk["choices"][0] if chunk.get("choices") else {}
                piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                if piece:
                    text.append(piece)
                    count += 1
                    if on_token:
                        on_token(count, node)
    return "".join(text), comments, node


def stack_env(var_dir: Path, database_url: str, namespace: str, **extra: str) -> dict:
    """The environment of a stack of its own: its database, its var folder, its Redis keys under `namespace`."""
    return {
        **os.environ,
        "DATABASE_URL": database_url,
        "LIFELINE_VAR_DIR": str(var_dir),
        "LIFELINE_NAMESPACE": namespace,
        "PYTHONUNBUFFERED": "1",
        **extra,
    }


def demo(var_dir: Path, env: dict, *options: str, gateways: int = 1, traffic: bool = False) -> DemoStack:
    """`manage.py demo` with `options` (nodes, spares, time scale, restart delay…), its console and gateways on free
    ports; not yet started. Its gateway's address is `gateway_url`."""
    from console.stack import free_port

    gateway_port = free_port(count=gateways)
    argv = [sys.executable, "manage.py", "demo", "--port", str(free_port()), "--gateway-port", str(gateway_port)]
    argv += ["--gateways", str(gateways)] if gateways > 1 else []
    argv += [] if traffic else ["--no-traffic"]
    stack = DemoStack(var_dir, env, [*argv, *options])
    stack.gateway_url = f"http://127.0.0.1:{gateway_port}"
    return stack
