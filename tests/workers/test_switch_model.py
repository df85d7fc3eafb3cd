"""A node told to serve another model (a placement plan's move, issue 14): drained, it leaves, starts again as the
same process and node on the same GPUs with the new model, loads it cold (its draft first), and serves it. A
model that does not fit its GPUs, one it already serves, or a node still holding requests is refused, saying so."""

import json
import threading
import urllib.request

from tests.helpers import http_json, wait_for
from workers import node as node_module

AGENT = "switch-agent-token"
HEAD = {"Authorization": f"Bearer {AGENT}"}
ENV = {"LIFELINE_AGENT_TOKEN": AGENT}


def models_of(address: str) -> list[str]:
    try:
        status, body = http_json(address + "/v1/models", timeout=2)
    except OSError:
        return []
    return [m["id"] for m in body["data"]] if status == 200 else []


def healthy(address: str) -> bool:
    try:
        return http_json(address + "/health", timeout=2)[0] == 200
    except OSError:
        return False


def test_a_drained_node_switches_model_in_place_and_serves_it(node_factory):
    node = node_factory("switch-1", "--model", "Qwen3-32B", "--tp", "2", "--time-scale", "0.05", env=ENV)
    pid = node.pid
    assert models_of(node.address) == ["Qwen3-32B"]
    status, body = http_json(node.address + "/agent/model", data={"model": "Llama-3-8B"}, headers=HEAD)
    assert status == 202 and body == {"switching": True, "from": "Qwen3-32B", "model": "Llama-3-8B"}
    # The same process starts again: a new listening line, same pid, the new model loading cold.
    again = json.loads(node.proc.stdout.readline())
    assert again["event"] == "listening" and again["pid"] == pid and again["name"] == "switch-1"
    node.address = again["address"]
    wait_for(lambda: healthy(node.address), 30, message="the new model serving")
    assert models_of(node.address) == ["Llama-3-8B"]
    status, body = http_json(
        node.address + "/v1/chat/completions",
        data={"model": "Llama-3-8B", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4},
    )
    assert status == 200 and body["model"] == "Llama-3-8B" and body["usage"]["completion_tokens"] == 4
    status, capabilities = http_json(node.address + "/agent/capabilities")
    assert capabilities["engine"]["kind"] == "emulated"


def test_a_switch_is_refused_while_requests_are_in_flight_or_when_the_model_cannot_serve_here(node_factory):
    node = node_factory("switch-2", "--model", "Qwen3-32B", "--tp", "1", "--time-scale", "20", env=ENV)
    url = node.address + "/agent/model"
    assert http_json(url, data={"model": "Llama-3-8B"})[0] == 401  # the agent token, as every control endpoint
    for body, status, words in [
        ({"model": "GPT-9"}, 400, "'GPT-9' is not a catalog model"),
        ({"model": "Llama-3.2-1B"}, 400, "is not a catalog model this node can serve"),  # a draft model
        ({}, 400, "None is not a catalog model"),
        ({"model": "Llama-3-70B"}, 400, "use a tensor-parallel degree of at least"),  # 141 GB on one H100
        ({"model": "Qwen3-32B"}, 409, "already serves Qwen3-32B"),
    ]:
        answer_status, answer = http_json(url, data=body, headers=HEAD)
        assert answer_status == status and words in answer["error"]["message"], (body, answer)
    # A long request in flight: the node must be drained first.
    request = urllib.request.Request(
        node.address + "/v1/completions",
        data=json.dumps({"model": "Qwen3-32B", "prompt": "x " * 50, "max_tokens": 3000, "ignore_eos": True}).encode(),
        headers={"Content-Type": "application/json"},
    )

    def send():
        try:
            urllib.request.urlopen(request, timeout=60).read()
        except OSError:
            pass  # the node stops at the test's end with the request still running

    worker = threading.Thread(target=send, daemon=True)
    worker.start()
    running = lambda: http_json(node.address + "/agent/status")[1]["load"].get("running")  # noqa: E731
    wait_for(running, 10, message="the request running")
    status, body = http_json(url, data={"model": "Llama-3-8B"}, headers=HEAD)
    assert status == 409 and "in flight here: drain the node first" in body["error"]["message"]
    assert models_of(node.address) == ["Qwen3-32B"] and node.proc.poll() is None


def test_the_restarted_command_line_keeps_everything_but_the_model_and_loads_cold():
    argv = ["--name", "n1", "--model", "Qwen3-32B", "--start=warm", "--tp", "2", "--model=Llama-3-8B", "--rack", "r"]
    assert node_module.switched_argv(argv, "Llama-3-70B") == [
        "--name", "n1", "--tp", "2", "--rack", "r", "--model", "Llama-3-70B", "--start", "cold",
    ]  # fmt: skip


def test_a_switched_node_started_again_with_its_first_command_line_serves_the_model_it_switched_to(
    node_factory, tmp_path
):
    state = tmp_path / "state" / "switch-3.json"
    first = ("--model", "Qwen3-32B", "--tp", "2", "--time-scale", "0.05", "--state-file", str(state))
    node = node_factory("switch-3", *first, env=ENV)
    status, _ = http_json(node.address + "/agent/model", data={"model": "Llama-3-8B"}, headers=HEAD)
    assert status == 202
    node.address = json.loads(node.proc.stdout.readline())["address"]
    wait_for(lambda: healthy(node.address), 30, message="the new model serving")
    assert json.loads(state.read_text()) == {"model": "Llama-3-8B", "started_as": "Qwen3-32B"}

    # It crashes; its supervisor starts it again with the command line it first had.
    node.kill()
    again = node_factory("switch-3", *first, env=ENV)
    wait_for(lambda: healthy(again.address), 30, message="the switched model serving after the restart")
    assert models_of(again.address) == ["Llama-3-8B"]
    again.kill()
    # An operator who starts it with another model gets that model.
    chosen = node_factory("switch-3", *first[:-2], "--state-file", str(state), "--model", "Qwen3-14B", env=ENV)
    wait_for(lambda: healthy(chosen.address), 30, message="the operator's model serving")
    assert models_of(chosen.address) == ["Qwen3-14B"]


def test_the_state_file_is_applied_only_to_the_command_line_it_was_made_under(tmp_path):
    state = tmp_path / "node.json"

    def started(*argv):
        args = node_module.parse_args(["--name", "n", "--start", "warm", "--state-file", str(state), *argv])
        return node_module.resume_switch(args), args.model, args.start

    assert started("--model", "Qwen3-32B") == ("Qwen3-32B", "Qwen3-32B", "warm")  # no file yet
    node_module.remember_switch(str(state), "Llama-3-8B", "Qwen3-32B")
    assert started("--model", "Qwen3-32B") == ("Qwen3-32B", "Llama-3-8B", "cold")  # the crash restart
    assert started("--model", "Llama-3-8B") == ("Qwen3-32B", "Llama-3-8B", "warm")  # the switch's own start
    assert started("--model", "Qwen3-14B") == ("Qwen3-14B", "Qwen3-14B", "warm")  # the operator's choice
    state.write_text("{not json")
    assert started("--model", "Qwen3-32B") == ("Qwen3-32B", "Qwen3-32B", "warm")  # unreadable: ignored, said
