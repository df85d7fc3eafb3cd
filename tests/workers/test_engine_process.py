"""The real engine a node owns (--engine-command): started, started again when it dies, reloaded through its own
graceful shutdown, its GPUs reset while it is stopped, and stopped with its node.

The supervisor is tested on plain processes; the node on a real llama-server (harness/real_engine.py). This host has
no GPU, so the GPU reset runs a stand-in command that records what it was given and whether the engine was still
listening when it ran: the order (stop, reset, start) is what the test holds, not nvidia-smi itself.
"""

import asyncio
import json
import os
import signal
import socket
import sys
import threading
import time

import pytest

from harness.real_engine import LlamaServer, tiny_model
from tests.helpers import NodeProcess, http_json, wait_for
from workers import engine_process
from workers.engine_process import EngineProcess

AGENT = "engine-process-agent-token"
AGENT_HEAD = {"Authorization": f"Bearer {AGENT}"}
ENV = {"LIFELINE_AGENT_TOKEN": AGENT}
MODEL = "Tiny-Llama"
SERVED_AS = "lifeline/tiny-llama"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# --- the supervisor, on plain processes -------------------------------------------------------------------------


async def test_an_engine_that_dies_unbidden_is_started_again_and_a_stop_is_not_a_death(monkeypatch):
    monkeypatch.setattr(engine_process, "RESTART_DELAY_S", 0.05)
    process = EngineProcess(f"{sys.executable} -c 'import time; time.sleep(60)'")
    exits, starts = [], []

    async def on_exit(code):
        exits.append(code)

    async def on_start():
        starts.append(process.pid)

    process.on_exit, process.on_start = on_exit, on_start
    await process.start()
    first = process.pid
    assert first is not None and _alive(first)
    os.kill(first, signal.SIGKILL)
    for _ in range(100):
        if starts:
            break
        await asyncio.sleep(0.05)
    assert exits == [-signal.SIGKILL] and starts and starts[0] != first
    assert process.starts == 2 and process.unbidden_exits == 1
    second = process.pid
    assert second is not None
    assert await process.stop() == -signal.SIGTERM
    await asyncio.sleep(0.3)
    assert process.starts == 2 and process.pid is None and not _alive(second)  # a stop is not restarted


async def test_an_engine_deaf_to_sigterm_is_killed_after_the_stop_timeout():
    deaf = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    process = EngineProcess(f"{sys.executable} -c {json.dumps(deaf)}", stop_timeout_s=0.5)
    await process.start()
    await asyncio.sleep(0.5)  # its handler in place
    started = time.monotonic()
    assert await process.stop() == -signal.SIGKILL
    assert 0.4 < time.monotonic() - started < 5


async def test_a_gpu_reset_runs_between_the_engines_stop_and_its_start(tmp_path):
    record = tmp_path / "reset.jsonl"
    script = tmp_path / "reset.py"
    script.write_text(
        "import json, sys\n"
        "pid, gpus = int(sys.argv[1].split('=')[1]), sys.argv[2].split('=')[1]\n"
        "import os\n"
        "try:\n    os.kill(pid, 0); alive = True\nexcept ProcessLookupError:\n    alive = False\n"
        f"open({str(record)!r}, 'a').write(json.dumps({{'engine_alive': alive, 'gpus': gpus}}) + '\\n')\n"
    )
    process = EngineProcess(
        f"{sys.executable} -c 'import time; time.sleep(60)'", reset_command="placeholder", gpus=(0, 3)
    )
    await process.start()
    first = process.pid
    assert first is not None
    process.reset_command = f"{sys.executable} {script} --pid={first} --gpus={{gpus}}"
    assert await process.restart(reset=True)
    assert json.loads(record.read_text()) == {"engine_alive": False, "gpus": "0,3"}
    assert process.pid not in (None, first) and process.resets == 1 and process.unbidden_exits == 0
    # A reset that fails is said, and the engine is started again all the same.
    process.reset_command = f"{sys.executable} -c 'import sys; print(\"GPU 00000000:3B:00.0 is in use\"); sys.exit(3)'"
    assert not await process.restart(reset=True)
    assert process.reset_failures == 1 and process.pid is not None
    assert process.last_reset is not None and "exit 3: GPU 00000000:3B:00.0 is in use" in process.last_reset
    await process.stop()


# An engine that answers /health and /metrics, writes each request it takes to its log, and on SIGTERM says so and
# serves on for half a second before it exits: a stand-in for llama-server, whose exit waits for its handlers.
LINGERING_ENGINE = """
import http.server, signal, sys, threading, time
log = open(sys.argv[2], "a", buffering=1)
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        log.write("request " + self.path + "\\n")
        body = b"llamacpp:requests_processing 0\\n" if self.path == "/metrics" else b"{}"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
def term(*_):
    log.write("sigterm\\n")
    threading.Timer(0.5, lambda: (log.write("exit\\n"), server.shutdown())).start()
signal.signal(signal.SIGTERM, term)
log.write("start\\n")
server.serve_forever()
"""


async def test_the_node_sends_its_engine_no_poll_while_the_engine_stops(tmp_path):
    """A poll taken on while the engine stops holds up its exit (llama-server waits for its handlers), and so the
    reset that waits for the exit: the adapter stops polling before it stops the engine, and polls again after."""
    from workers import catalog
    from workers.adapter import AdapterEngine

    script, log = tmp_path / "engine.py", tmp_path / "requests.log"
    script.write_text(LINGERING_ENGINE)
    port = _free_port()
    process = EngineProcess(f"{sys.executable} {script} {port} {log}", stop_timeout_s=10)
    deployment = catalog.Deployment.of("Qwen3-32B", "H100-SXM", 1)
    adapter = AdapterEngine(
        f"http://127.0.0.1:{port}", deployment, "lingering", "llamacpp", poll_s=0.01, process=process, ready_wait_s=5
    )
    # What the adapter does, in order: the engine's own log cannot tell a poll sent while it stopped from one sent
    # just before its SIGTERM that its handler thread logged late (as happens on a loaded machine).
    events: list[str] = []
    poll, stop = adapter._poll, process._stop

    async def recorded_poll(session):
        events.append("poll")
        try:
            await poll(session)
        finally:
            events.append("poll done")

    async def recorded_stop():
        events.append("stop")
        await stop()
        events.append("stopped")

    adapter._poll, process._stop = recorded_poll, recorded_stop
    adapter.start()
    await adapter.start_process()
    try:
        for _ in range(200):
            if log.exists() and log.read_text().count("request /metrics") >= 3:
                break
            await asyncio.sleep(0.02)
        assert adapter.reload() == 0
        assert adapter._restarting is not None
        await adapter._restarting
        for _ in range(200):  # polled again once the fresh engine is up
            if log.read_text().split("start\n")[-1].count("request /metrics") >= 3:
                break
            await asyncio.sleep(0.02)
    finally:
        await adapter.stop()
    before, stopping = events[: events.index("stop")], events[events.index("stop") : events.index("stopped")]
    assert before.count("poll") == before.count("poll done") >= 3, f"a poll was under way at the stop: {before}"
    assert stopping == ["stop"], f"the adapter polled the engine while it stopped: {stopping[1:]}"
    lines = log.read_text().splitlines()
    assert lines.count("start") == 2 and lines[lines.index("exit") + 1 :].count("request /metrics") >= 3


async def test_a_node_stopped_during_an_engine_restart_leaves_no_poll_running(tmp_path):
    """The restart resumes polling when the engine is back, but not when the node's stop cancelled it: a poll loop
    left behind would go on against a closed session."""
    from workers import catalog
    from workers.adapter import AdapterEngine

    script, log = tmp_path / "engine.py", tmp_path / "requests.log"
    script.write_text(LINGERING_ENGINE)
    port = _free_port()
    process = EngineProcess(f"{sys.executable} {script} {port} {log}", stop_timeout_s=10)
    deployment = catalog.Deployment.of("Qwen3-32B", "H100-SXM", 1)
    adapter = AdapterEngine(f"http://127.0.0.1:{port}", deployment, "stopped", "llamacpp", poll_s=0.01, process=process)
    adapter.start()
    await adapter.start_process()
    for _ in range(200):
        if log.exists() and "request /metrics" in log.read_text():
            break
        await asyncio.sleep(0.02)
    adapter.reload()
    await asyncio.sleep(0.1)  # the restart waits for the engine's exit (half a second)
    await adapter.stop()
    polls = [t for t in asyncio.all_tasks() if t.get_name() == "engine-metrics" and not t.done()]
    assert polls == [], "a poll loop outlived the node's stop"


def test_the_default_gpu_reset_is_offered_only_where_the_host_allows_it(monkeypatch):
    monkeypatch.setattr(engine_process.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(engine_process.os, "geteuid", lambda: 0)
    assert engine_process.default_reset_command([0, 1]) == "nvidia-smi --gpu-reset -i {gpus}"
    assert engine_process.default_reset_command([]) is None  # NVML saw no GPU
    monkeypatch.setattr(engine_process.os, "geteuid", lambda: 1000)
    assert engine_process.default_reset_command([0, 1]) is None  # a reset needs root
    monkeypatch.setattr(engine_process.os, "geteuid", lambda: 0)
    monkeypatch.setattr(engine_process.shutil, "which", lambda name: None)
    assert engine_process.default_reset_command([0, 1]) is None


# --- a node owning a real llama-server --------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def owned(node_factory, tmp_path):
    """`start(port, *extra)`: a node that starts its own llama-server on the tiny model (--engine-command), the
    server to listen on `port`."""

    def start(port: int, *extra: str) -> tuple[NodeProcess, LlamaServer]:
        server = LlamaServer(tiny_model(tmp_path / "tiny.gguf"), alias=SERVED_AS)
        server.port = port
        command = " ".join(server.command())
        node = node_factory(
            "owner",
            *("--engine-url", server.url, "--engine-command", command, "--model", MODEL),
            *("--engine-log", str(tmp_path / "engine.log"), *extra),
            # Now and then llama-server misses a SIGTERM for good (no "cleaning up before exit" in its log; seen
            # about one stop in ten here): the stop timeout's SIGKILL is what ends it then. The default 30 s would
            # equal the waits below; 5 s keeps the kill well inside them.
            *("--engine-stop-timeout", "5"),
            env=ENV,
        )
        wait_for(lambda: http_json(node.address + "/health")[0] == 200, 60, 0.1, "the node serving its own engine")
        return node, server

    return start


def _engine(node: NodeProcess) -> dict:
    return http_json(node.address + "/agent/capabilities")[1]


def _complete(node: NodeProcess, prompt: str = "The fleet", max_tokens: int = 24) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    status, answer = http_json(node.address + "/v1/completions", data=body, timeout=60)
    assert status == 200, answer
    return answer["choices"][0]["text"]


def _stream_until_error(node: NodeProcess, started: threading.Event, out: dict) -> None:
    """A long stream straight to the node: how many tokens came, and whether it ended with an error."""
    import urllib.request

    body = {"model": MODEL, "prompt": "A long story", "max_tokens": 1500, "temperature": 0, "stream": True}
    request = urllib.request.Request(
        node.address + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    out["tokens"], out["error"] = 0, None
    with urllib.request.urlopen(request, timeout=60) as response:
        for line in response:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                out["error"] = data["error"]
                break
            out["tokens"] += 1
            started.set()


def test_a_node_owning_its_engine_reloads_resets_and_restarts_it_and_stops_it_with_itself(owned, tmp_path):
    record = tmp_path / "reset.jsonl"
    script = tmp_path / "reset.py"
    script.write_text(
        "import json, socket, sys\n"
        "port, gpus = int(sys.argv[1].split('=')[1]), sys.argv[2].split('=')[1]\n"
        "s = socket.socket()\n"
        "listening = s.connect_ex(('127.0.0.1', port)) == 0\n"
        f"open({str(record)!r}, 'a').write(json.dumps({{'engine_listening': listening, 'gpus': gpus}}) + '\\n')\n"
    )
    port = _free_port()
    node, _ = owned(port, "--gpu-reset-command", f"{sys.executable} {script} --port={port} --gpus={{gpus}}")
    described = _engine(node)
    assert {"reload", "reset", "resume"} <= set(described["offers"]) and "reset" not in described["cannot"]
    first = described["engine"]["process"]["pid"]
    assert first and _alive(first)
    undisturbed = _complete(node)

    # A GPU reset while a stream runs: the stream fails (the gateway would resume it elsewhere), the engine is
    # stopped, the reset runs while nothing listens on the engine's port, and the engine comes back and serves.
    started, out = threading.Event(), {}
    reader = threading.Thread(target=_stream_until_error, args=(node, started, out), daemon=True)
    reader.start()
    assert started.wait(30), "the stream started"
    status, answer = http_json(node.address + "/agent/reset", data={}, headers=AGENT_HEAD)
    assert status == 200 and answer["aborted"] == 1 and answer["model_state"] == "loading_full", answer
    reader.join(30)
    assert out["error"] is not None and 0 < out["tokens"] < 1500, out
    wait_for(lambda: record.exists(), 30, 0.1, "the GPU reset command ran")
    assert json.loads(record.read_text()) == {"engine_listening": False, "gpus": ""}  # no GPU NVML sees here
    wait_for(lambda: http_json(node.address + "/health")[0] == 200, 60, 0.1, "serving again after the reset")
    after_reset = _engine(node)["engine"]["process"]
    assert after_reset["pid"] not in (None, first) and not _alive(first)
    assert after_reset["resets"] == 1 and after_reset["reset_failures"] == 0
    assert _complete(node) == undisturbed  # the same engine on the same weights

    # A reload: the engine's graceful shutdown and a fresh start, no reset.
    status, answer = http_json(node.address + "/agent/reload", data={"cold": True}, headers=AGENT_HEAD)
    assert status == 200 and answer["aborted"] == 0, answer
    wait_for(lambda: _engine(node)["engine"]["process"]["pid"] not in (None, after_reset["pid"]), 30, 0.1, "reloaded")
    wait_for(lambda: http_json(node.address + "/health")[0] == 200, 60, 0.1, "serving again after the reload")
    assert len(record.read_text().splitlines()) == 1  # a reload resets nothing

    # The engine killed behind the node's back: started again, out of service until it answers, then serving.
    before = _engine(node)["engine"]["process"]
    os.kill(before["pid"], signal.SIGKILL)
    wait_for(lambda: _engine(node)["engine"]["process"]["unbidden_exits"] == 1, 30, 0.1, "the death seen")
    wait_for(lambda: http_json(node.address + "/health")[0] == 200, 60, 0.1, "serving again after the death")
    assert _engine(node)["engine"]["process"]["pid"] not in (None, before["pid"])
    assert _complete(node) == undisturbed

    # The node stopped: its engine with it.
    last = _engine(node)["engine"]["process"]["pid"]
    node.stop()
    assert node.proc is not None and node.proc.returncode == 0
    wait_for(lambda: not _alive(last), 10, 0.1, "the engine stopped with its node")


def test_without_a_gpu_to_reset_a_node_offers_reload_but_no_reset(owned):
    node, _ = owned(_free_port())
    described = _engine(node)
    assert "reload" in described["offers"] and "reset" not in described["offers"]
    assert described["engine"]["process"]["gpu_reset"] is None
    status, answer = http_json(node.address + "/agent/reset", data={}, headers=AGENT_HEAD)
    assert status == 501 and "cannot reset its GPUs on request" in answer["error"]["message"], answer
    status, answer = http_json(node.address + "/agent/model", data={"model": "Qwen3-32B"}, headers=AGENT_HEAD)
    assert status == 501 and "real engine" in answer["error"]["message"], answer


def test_a_node_whose_engine_command_keeps_dying_is_refused_with_the_engine_s_log_named(tmp_path):
    log = tmp_path / "engine.log"
    node = NodeProcess(
        "doomed",
        *("--engine-url", f"http://127.0.0.1:{_free_port()}", "--model", MODEL, "--engine-log", str(log)),
        *("--engine-command", f"{sys.executable} -c 'import sys; print(\"no such model\"); sys.exit(2)'"),
        env=ENV,
        log_dir=tmp_path,
    ).start()
    assert node.proc is not None
    assert node.proc.wait(timeout=60) == 3
    said = (tmp_path / "doomed.log").read_text()
    assert "exited 3 times before it answered /health" in said and str(log) in said, said[-2000:]
    assert "no such model" in log.read_text()


def test_an_engine_command_without_an_engine_url_is_refused(tmp_path):
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "workers.node", "--engine-command", "vllm serve x", "--model", MODEL],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--engine-command starts a real engine: give --engine-url too" in done.stderr
