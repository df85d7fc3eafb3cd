"""Real processes for the tests: serving nodes and whole Lifeline stacks."""

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
# Examples a property test draws by default, in the suite's `ci` profile and in the `full` one (tests/conftest.py).
EXAMPLES_CI, EXAMPLES_FULL = 25, 100


def examples(full: int) -> int:
    """The examples for a property test that draws `full` under the `full` profile: the same share of it as the
    loaded profile draws by default (a quarter in `ci`), never fewer than 10."""
    import hypothesis

    return max(10, round(full * hypothesis.settings.default.max_examples / EXAMPLES_FULL))


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
        base = self.info["urls"]["console"].rstrip("/")
        return http_json(base + path, headers={"Authorization": f"Bearer {self.info['api_token']}"})

    def node(self, name: str) -> dict:
        status, body = self.api("/api/cluster")
        assert status == 200, body
        return next(n for n in body["nodes"] if n["name"] == name)

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


# --- the browser -------------------------------------------------------------------------
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


def chromium_path() -> str:
    path = os.environ.get("LIFELINE_CHROMIUM") or shutil.which("chromium")
    if not path:
        raise RuntimeError(
            "Chromium is not installed: `./lifeline test` installs Debian's chromium when run as root, "
            "or set LIFELINE_CHROMIUM"
        )
    return path


def log_in(page, stack, role):
    login = next(item for item in stack.info["logins"] if item["role"] == role)
    page.goto(stack.info["urls"]["cluster"])
    page.fill("#id_username", login["username"])
    page.fill("#id_password", login["password"])
    page.click("button[type=submit]")
    page.wait_for_selector("#live-status[data-state=live]", timeout=10_000)


def follow_stream(client, results: dict, key, model: str, prompt: str, max_tokens: int) -> None:
    """A greedy completion (ignore_eos) streamed through the gateway by an OpenAI client into results[key], as it
    comes: the node that took it, its request id, the text and token ids, and the SSE comments (OpenAI clients skip
    them; a live move is announced in one)."""
    with client.completions.with_streaming_response.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True, extra_body={"ignore_eos": True}
    ) as response:
        text, ids, comments = [], [], []
        results[key] = {
            "node": response.headers["x-lifeline-node"],
            "request_id": response.headers["x-request-id"],
            "text": text,
            "ids": ids,
            "comments": comments,
        }
        for line in response.iter_lines():
            if line.startswith(":"):
                comments.append(line)
            elif line.startswith("data: {"):
                for choice in json.loads(line[6:]).get("choices", []):
                    text.append(choice["text"])
                    ids.extend(choice.get("token_ids") or [])


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


async def sse_choices(address: str, path: str, body: dict, headers: dict | None = None) -> tuple[list[dict], dict]:
    """The choices of every chunk of a streamed answer, and its usage."""
    import aiohttp

    choices, usage = [], None
    async with aiohttp.ClientSession() as session:
        async with session.post(
            address + path,
            json={**body, "stream": True, "stream_options": {"include_usage": True}},
            headers=headers or {},
        ) as response:
            assert response.status == 200, await response.text()
            async for raw in response.content:
                line = raw.decode().strip()
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    choices += chunk["choices"]
                    usage = chunk.get("usage") or usage
    return choices, usage


@asynccontextmanager
async def buffered_burst(body: bytes):
    """A response whose whole `body` (an event stream) already sits in the client's buffer, as when a node or an
    engine sends faster than it is relayed: served by a local aiohttp server in one write."""
    import aiohttp
    from aiohttp import web

    async def burst(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(body)
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", burst)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://127.0.0.1:{port}/v1/completions", json={}) as response:
                deadline = time.monotonic() + 10
                while not response.content.is_eof() and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                assert response.content.is_eof(), "the burst did not arrive whole"
                yield response
    finally:
        await runner.cleanup()


async def longest_hold_of_the_loop(items) -> tuple[int, int]:
    """How many items of the async iterator `items` came one after another with no other task given a turn of the
    event loop in between (the longest such run), and how many items there were."""
    turns = 0

    async def other_work() -> None:
        nonlocal turns
        while True:
            await asyncio.sleep(0)
            turns += 1

    task = asyncio.create_task(other_work())
    await asyncio.sleep(0)
    longest = run = count = 0
    seen = turns
    try:
        async for _ in items:
            count += 1
            run = run + 1 if turns == seen else 1
            seen, longest = turns, max(longest, run)
    finally:
        task.cancel()
    return longest, count
