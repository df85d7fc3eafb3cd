"""A serving cluster for the recovery benchmarks: real nodes, a real gateway, Redis.

The harness plays the control plane's part that matters to the data path:
it publishes the routing table, the gateway keys and the cluster settings,
takes a killed node out of routing a second later (as confirmation would),
restarts it (cold: draft first) and pairs its draft model with the most
loaded survivor until its full model is ready, as progressive recovery does.
Clients are aiohttp streams that check every token against the pure token
function, so a lost or repeated token cannot go unnoticed.
"""

import asyncio
import hashlib
import json
import os
import secrets
import signal
import time
import urllib.request
from dataclasses import dataclass, field

import aiohttp
import redis

from benchmarks.common import AGENT_TOKEN, BASE_DIR, HEAD, Node
from recovery.keys import Keys
from workers import tokens

KEY = "llk_benchmark-key"


def ensure_redis() -> None:
    """The benchmarks use REDIS_URL's Redis, else one of their own."""
    if not os.environ.get("REDIS_URL"):
        import tempfile
        from pathlib import Path

        from console.stack import Supervisor, start_embedded_redis

        supervisor = Supervisor(Path(tempfile.mkdtemp(prefix="bench-redis-")))
        os.environ["REDIS_URL"] = start_embedded_redis(supervisor, Path(tempfile.mkdtemp()))
        import atexit

        atexit.register(supervisor.stop)


WORDS = [w for w in tokens.VOCAB if w.isalpha()]  # for random prompts


def expected_ids(model: str, prompt: str, max_tokens: int, ignore_eos: bool = False) -> list[int]:
    """The tokens an undisturbed greedy run produces: the product's correctness reference."""
    state = tokens.fold(tokens.initial_state(model), tokens.encode(prompt))
    out = []
    for position in range(max_tokens):
        choice = tokens.next_token(state, position, 0.0, 0)
        out.append(choice.token_id)
        if choice.token_id == tokens.EOS and not ignore_eos:
            break
        state = tokens.advance(state, choice.token_id)
    return out


@dataclass
class Result:
    request_id: str
    started: float
    prompt_tokens: int
    ids: list[int] = field(default_factory=list)
    expected: list[int] = field(default_factory=list)
    first_at: float | None = None
    last_at: float | None = None
    stalls_ms: list[float] = field(default_factory=list)
    moves: list[str] = field(default_factory=list)
    error: str | None = None
    node: str | None = None  # the node the gateway first sent it to

    @property
    def ttft_s(self) -> float | None:
        return self.first_at - self.started if self.first_at else None

    @property
    def tpot_s(self) -> float | None:
        if not self.first_at or len(self.ids) < 2:
            return None
        return (self.last_at - self.first_at) / (len(self.ids) - 1)

    @property
    def lost(self) -> int:
        """Tokens of the reference the client never got (0 when intact)."""
        if self.error:
            return len(self.expected) - len(self.ids)
        return len(self.expected) - sum(1 for a, b in zip(self.ids, self.expected) if a == b)

    @property
    def repeated_or_wrong(self) -> int:
        return max(len(self.ids) - len(self.expected), 0) + sum(1 for a, b in zip(self.ids, self.expected) if a != b)


class Harness:
    def __init__(
        self,
        nodes: int,
        model: str = "Qwen3-32B",
        gpu: str = "H100-SXM",
        tp: int = 1,
        racks: int = 2,
        policy: str = "lifeline",
        time_scale: float = 1.0,
        extra: tuple = (),
        config: dict | None = None,
        restart: str = "cold",
        assist: bool = True,
    ):
        ensure_redis()
        self.restart = restart
        self.assist = assist  # pair a restarting node's draft with a survivor (progressive recovery)
        self.namespace = f"bench-{secrets.token_hex(3)}"
        self.keys = Keys(self.namespace)
        self.redis = redis.Redis.from_url(os.environ["REDIS_URL"], decode_responses=True)
        self.model, self.gpu, self.tp, self.racks = model, gpu, tp, racks
        self.time_scale, self.extra = time_scale, extra
        self.config = {"placement_policy": policy, **(config or {})}
        self.count = nodes
        self.nodes: dict[str, Node] = {}
        self.rack_of: dict[str, str] = {}
        self.assisting: dict[str, str] = {}  # restarting node -> survivor it assists
        self.gateway_url = ""
        self.capabilities: list[str] | None = None  # what the nodes offer, where not all an emulated node does
        # Each node's place in the fabric beyond its rack ({"server": ..., "nvl_domain": ...}), given to the node and
        # published in its route; a node not named here is alone on its server (workers.catalog.Placement).
        self.fabric: dict[str, dict[str, str]] = {}
        self.cordoned: set[str] = set()  # routed with weight 0: no new requests, no checkpoints (a drain's cordon)
        self.restarts: list[dict] = []  # each kill's restart: start mode, when the node was killed, ready, assisted
        self._server = None
        self._more_gateways: list = []  # start_more_gateways
        self._port_mates: list = []  # start_gateway(processes > 1): the processes sharing the first one's port
        self.gateway_urls: list[str] = []
        self._tasks: list[asyncio.Task] = []

    # --- the cluster ----------------------------------------------------------------------
    def _args(self, name: str, start: str) -> tuple:
        return (
            "--model",
            self.model,
            "--gpu",
            self.gpu,
            "--tp",
            str(self.tp),
            "--rack",
            self.rack_of[name],
            "--time-scale",
            str(self.time_scale),
            "--start",
            start,
            *(arg for key, value in self.fabric.get(name, {}).items() for arg in (f"--{key.replace('_', '-')}", value)),
            *self.extra,
        )

    def start_nodes(self) -> None:
        for i in range(self.count):
            name = f"n{i:02d}"
            self.rack_of[name] = f"rack-{i * self.racks // self.count}"
            self.nodes[name] = Node(name, *self._args(name, "warm"))
        self.publish()

    def serving(self) -> list[str]:
        return [n for n, node in self.nodes.items() if node.proc.poll() is None and self._state(node) == "serving"]

    def _state(self, node: Node) -> str:
        try:
            return node.status()["load"]["model_state"]
        except OSError:
            return "down"

    def publish(self) -> None:
        routes = {}
        for name in self.serving():
            node = self.nodes[name]
            routes[name] = json.dumps(
                {
                    "address": node.address,
                    "model": self.model,
                    "rack": self.rack_of[name],
                    "gpu": self.gpu,
                    "tp": self.tp,
                    "weight": 0.0 if name in self.cordoned else 1.0,
                    **self.fabric.get(name, {}),
                    "session": str(node.proc.pid),
                    **({"capabilities": self.capabilities} if self.capabilities is not None else {}),
                }
            )
        pipe = self.redis.pipeline()
        pipe.delete(self.keys.routing)
        if routes:
            pipe.hset(self.keys.routing, mapping=routes)
        pipe.hset(
            self.keys.gateway_keys,
            hashlib.sha256(KEY.encode()).hexdigest(),
            json.dumps({"id": 1, "tenant": "bench", "tier": "standard"}),
        )
        pipe.set(self.keys.cluster_config, json.dumps(self.config))
        pipe.publish(self.keys.routing_changed, "1")
        pipe.execute()

    async def start_gateway(self, processes: int = 1) -> None:
        """The gateway as its own process, as in production (`manage.py gateway`); with `processes` > 1, that many
        on one port (`--reuse-port`: the kernel spreads the connections), as one host runs one per core."""
        from console.stack import free_port

        port = free_port() if processes > 1 else None
        self._server, self.gateway_url = await self._spawn_gateway("bench-gw", port)
        for i in range(1, processes):
            self._port_mates.append((await self._spawn_gateway(f"bench-gw-port-{i + 1}", port))[0])

    def gateway_pids(self) -> list[int]:
        """The processes of the gateway started by `start_gateway` (one, or all sharing its port)."""
        return [proc.pid for proc in [self._server, *self._port_mates] if proc is not None]

    def stop_gateway(self, wait_s: float = 10) -> None:
        """Stop what `start_gateway` started (SIGTERM, then wait)."""
        for proc in [self._server, *self._port_mates]:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=wait_s)
        self._server, self._port_mates = None, []

    async def start_more_gateways(self, count: int) -> list[str]:
        """`count` more gateway processes sharing the routing table (as several behind a balancer); their URLs."""
        for i in range(count):
            proc, url = await self._spawn_gateway(f"bench-gw-{i + 2}")
            self._more_gateways.append(proc)
            self.gateway_urls.append(url)
        return self.gateway_urls

    async def _spawn_gateway(self, name: str, port: int | None = None):
        import subprocess
        import sys
        import tempfile

        from console.stack import free_port

        shared = port is not None
        port = port or free_port()
        env = {
            **os.environ,
            "LIFELINE_NAMESPACE": self.namespace,
            "LIFELINE_AGENT_TOKEN": AGENT_TOKEN,
            "LIFELINE_VAR_DIR": tempfile.mkdtemp(prefix="bench-gw-"),
            "LIFELINE_LOG_LEVEL": "WARNING",
        }
        log = open(os.environ["BENCH_GATEWAY_LOG"], "ab") if os.environ.get("BENCH_GATEWAY_LOG") else subprocess.DEVNULL
        proc = subprocess.Popen(
            [sys.executable, "manage.py", "gateway", "--port", str(port), "--name", name]
            + (["--reuse-port"] if shared else []),
            cwd=BASE_DIR,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        url = f"http://127.0.0.1:{port}"
        # A new connection per look: on a shared port the kernel hands each to one of the processes, so this one is
        # ready once one of them has reached it and it answers (under its own name) watching every node.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
            for _ in range(400):
                try:
                    async with session.get(url + "/healthz") as response:
                        health = await response.json()
                        if health["gateway"] == name and len(health["watching"]) == len(self.serving()):
                            return proc, url
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)
        raise RuntimeError(f"the gateway {name} did not start")

    async def kill(
        self, name: str, restart_after_s: float = 2.0, confirm_after_s: float = 1.0, start: str | None = None
    ) -> float:
        """SIGKILL a node; take it out of routing, restart it (`start`: cold or warm, the harness's `restart` unless
        given), and assist with its draft while it loads, as the control plane does."""
        killed_at = time.monotonic()
        self.nodes[name].stop(signal.SIGKILL)
        restart = {"node": name, "start": start or self.restart, "killed_at": killed_at}
        self.restarts.append(restart)
        self._tasks.append(asyncio.create_task(self._recover(name, restart_after_s, confirm_after_s, restart)))
        return killed_at

    async def _recover(self, name: str, restart_after_s: float, confirm_after_s: float, restart: dict) -> None:
        """Out of routing, restarted, assisting while it loads, back in routing; `restart` gets the moments
        (time.monotonic()) it was restarted, draft-ready, paired with a survivor and serving."""
        await asyncio.sleep(confirm_after_s)
        await asyncio.to_thread(self.publish)
        await asyncio.sleep(max(restart_after_s - confirm_after_s, 0))
        restart["restarted_at"] = time.monotonic()
        node = await asyncio.to_thread(Node, name, *self._args(name, restart["start"]))
        self.nodes[name] = node
        while (state := await asyncio.to_thread(self._state, node)) != "serving":
            states = restart.setdefault("states", [])  # the model states it went through, in order
            if state not in states:
                states.append(state)
            if state == "draft_ready":
                restart.setdefault("draft_ready_at", time.monotonic())
            if self.assist and state == "draft_ready" and name not in self.assisting:
                survivor = await asyncio.to_thread(self._most_loaded, name)
                if survivor and await asyncio.to_thread(
                    self._call,
                    self.nodes[survivor],
                    "POST",
                    "/agent/assist",
                    {
                        "draft": {"name": name, "address": node.address, "rack": self.rack_of[name]},
                        "k": 4,  # the agreement is the catalog's for the model pair (the node refuses an alpha)
                    },
                ):
                    self.assisting[name] = survivor
                    restart.update(assisted=survivor, assist_at=time.monotonic())
            await asyncio.sleep(0.2)
        survivor = self.assisting.pop(name, None)
        if survivor:
            await asyncio.to_thread(self._call, self.nodes[survivor], "DELETE", "/agent/assist", None)
        await asyncio.to_thread(self.publish)
        restart["serving_at"] = time.monotonic()

    def _most_loaded(self, exclude: str) -> str | None:
        loads = {}
        for name in self.serving():
            if name != exclude:
                load = self.nodes[name].status()["load"]
                loads[name] = load["running"] + load["waiting"] + load["checkpoint_bytes_held"] / 4_194_304
        return max(sorted(loads), key=loads.get) if loads else None

    @staticmethod
    def _call(node: Node, method: str, path: str, body: dict | None) -> bool:
        request = urllib.request.Request(
            node.address + path,
            method=method,
            data=json.dumps(body).encode() if body else None,
            headers={**HEAD, "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=5):
                return True
        except OSError:
            return False

    def signals(self, kind: str) -> list[dict]:
        """What the gateways told the control plane of `kind` (recovery.gateway.signals), oldest first."""
        entries = self.redis.xrange(self.keys.signals)
        return [json.loads(fields["data"]) for _, fields in entries if fields.get("kind") == kind]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.stop_gateway(wait_s=30)
        for server in self._more_gateways:
            server.terminate()
            server.wait(timeout=30)
        for node in self.nodes.values():
            node.stop(signal.SIGKILL)
        for key in self.redis.scan_iter(match=self.namespace + ":*"):
            self.redis.delete(key)

    # --- clients ----------------------------------------------------------------------------------
    async def request(
        self, session: aiohttp.ClientSession, prompt: str, max_tokens: int, gateway: str | None = None
    ) -> Result:
        return await checked_stream(session, (gateway or self.gateway_url) + "/v1", KEY, self.model, prompt, max_tokens)

    def gateway_metrics(self) -> str:
        return urllib.request.urlopen(self.gateway_url + "/metrics").read().decode()


async def checked_stream(
    session: aiohttp.ClientSession,
    gateway: str,
    key: str,
    model: str,
    prompt: str,
    max_tokens: int,
    ignore_eos: bool = False,
) -> Result:
    """One greedy streamed completion through the gateway at `gateway` (its /v1 URL), every token checked
    against the pure token function, and the stall around each move the gateway announces."""
    result = Result(f"b-{secrets.token_hex(6)}", time.monotonic(), len(tokens.encode(prompt)))
    result.expected = expected_ids(model, prompt, max_tokens, ignore_eos)
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "lifeline": {"request_id": result.request_id},
        **({"ignore_eos": True} if ignore_eos else {}),
    }
    moved_at = None
    try:
        async with session.post(
            gateway + "/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as response:
            result.node = response.headers.get("X-Lifeline-Node")
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            async for raw in response.content:
                if raw.startswith(b": lifeline moved"):
                    moved_at = result.last_at
                    result.moves.append(raw.decode().strip())
                    continue
                if not raw.startswith(b'data: {"id"'):
                    if raw.startswith(b'data: {"error"'):
                        result.error = raw.decode()[6:200]
                    continue
                chunk = json.loads(raw[6:])
                ids = (chunk["choices"][0].get("token_ids") or []) if chunk.get("choices") else []
                if ids:
                    now = time.monotonic()
                    if moved_at is not None:
                        result.stalls_ms.append((now - moved_at) * 1000)
                        moved_at = None
                    result.first_at = result.first_at or now
                    result.last_at = now
                    result.ids += ids
    except (aiohttp.ClientError, OSError) as exc:
        result.error = f"{exc.__class__.__name__}: {exc}"
    return result
