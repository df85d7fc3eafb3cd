"""A cluster for gateway tests: real node processes, the control plane's Redis state, gateways in the test's event
loop."""

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import time

import aiohttp
from aiohttp.test_utils import TestServer

from recovery.gateway.app import COORDINATOR_KEY, GatewayConfig, build_app
from tests.helpers import BASE_DIR, http_json

KEY = "llk_test-key-for-the-gateway"
AGENT = "agent-token-for-tests"
ENV = {"LIFELINE_AGENT_TOKEN": AGENT, "LIFELINE_FAULT_TOKEN": "fault", "LIFELINE_FAULTS_ENABLED": "1"}
SCALE = ("--time-scale", "0.3")


class Cluster:
    """Real nodes, a routing table and cluster settings in Redis, and gateways in this event loop."""

    def __init__(self, node_factory, redis_keys):
        self.node_factory = node_factory
        self.client, self.keys = redis_keys
        self.nodes = {}
        self.racks = {}
        self.gpus = {}
        self.models = {}  # node -> model, where not Qwen3-32B
        self.capabilities = {}  # node -> what it offers, where not all an emulated node does
        self.where = {}  # node -> {"provider": …, "region": …}, where said
        self.keys_extra = {}  # API key -> its entry ({"id", "tenant", "tier", "providers", "regions"})
        self.servers = []
        self.config = {"placement_policy": "load_aware", "stall_timeout_s": 2.0}

    def start_nodes(self, *names, racks=None, extra=(), gpu="H100-SXM"):
        for i, name in enumerate(names):
            self.nodes[name] = self.node_factory(name, *SCALE, "--enable-faults", "--gpu", gpu, *extra, env=ENV)
            self.racks[name] = (racks or {}).get(name, "rack-a" if i % 2 == 0 else "rack-b")
            self.gpus[name] = gpu
        self.publish()
        return [self.nodes[n] for n in names]

    def add_node(self, name, node, *, model, capabilities, rack="rack-a", gpu="H100-SXM"):
        """A node started by the test itself (an adapter in front of a real engine, say)."""
        self.nodes[name], self.racks[name], self.gpus[name] = node, rack, gpu
        self.models[name], self.capabilities[name] = model, list(capabilities)
        self.publish()

    def publish(self, config=None, cordoned=()):
        self.config.update(config or {})
        self.client.delete(self.keys.routing)
        routes = {
            name: json.dumps(
                {
                    "address": n.address,
                    "model": self.models.get(name, "Qwen3-32B"),
                    "rack": self.racks[name],
                    "gpu": self.gpus[name],
                    "tp": 1,
                    "weight": 0.0 if name in cordoned else 1.0,
                    "session": str(n.pid),
                    **({"capabilities": self.capabilities[name]} if name in self.capabilities else {}),
                    **self.where.get(name, {}),
                }
            )
            for name, n in self.nodes.items()
            if n.proc.poll() is None
        }
        if routes:
            self.client.hset(self.keys.routing, mapping=routes)
        models = sorted({"Qwen3-32B", *self.models.values()})
        self.client.set(self.keys.deployed_models, json.dumps(models))  # as the control plane publishes it
        self.client.hset(
            self.keys.gateway_keys,
            hashlib.sha256(KEY.encode()).hexdigest(),
            json.dumps({"id": 1, "tenant": "acme", "tier": "premium"}),
        )
        for key, entry in self.keys_extra.items():
            self.client.hset(self.keys.gateway_keys, hashlib.sha256(key.encode()).hexdigest(), json.dumps(entry))
        self.client.set(self.keys.cluster_config, json.dumps(self.config))
        self.client.publish(self.keys.routing_changed, "1")

    async def gateway(self, name="gw-test", **config) -> str:
        app = build_app(
            GatewayConfig(
                redis_url=os.environ["REDIS_URL"], namespace=self.keys.namespace, name=name, agent_token=AGENT, **config
            )
        )
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        self.servers.append(server)
        base = f"http://127.0.0.1:{server.port}"
        await self.until(
            base,
            lambda h: len(h["watching"]) == len([n for n in self.nodes.values() if n.proc.poll() is None]),
            "watching every node",
        )
        return base

    async def until(self, base, predicate, what, timeout=10):
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                async with session.get(base + "/healthz") as response:
                    health = await response.json()
                if predicate(health):
                    return health
                await asyncio.sleep(0.05)
        raise AssertionError(f"gateway never got to: {what} ({health})")

    async def flushed(self):
        """Every gateway's signals so far are in Redis."""
        for server in self.servers:
            await server.app[COORDINATOR_KEY].signals.flush()

    def signals(self, kind: str) -> list[dict]:
        return [
            json.loads(fields["data"]) for _, fields in self.client.xrange(self.keys.signals) if fields["kind"] == kind
        ]

    async def close(self):
        for server in self.servers:
            await server.close()


async def gw(url, **kwargs):
    """A call to the in-process gateway, from a thread: the gateway runs on this event loop."""
    return await asyncio.to_thread(http_json, url, **kwargs)


def gateway_process(namespace: str, name: str, tmp_path) -> tuple[subprocess.Popen, str]:
    """`manage.py gateway` as a process of its own, on a free port, reading the routing table under `namespace`; its
    address. Not waited for: the caller waits for what it needs of it."""
    from console.stack import free_port

    port = free_port()
    env = {
        **os.environ,
        "LIFELINE_NAMESPACE": namespace,
        "LIFELINE_AGENT_TOKEN": AGENT,
        "LIFELINE_VAR_DIR": str(tmp_path / name),
    }
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "gateway", "--port", str(port), "--name", name],
        cwd=BASE_DIR,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return proc, f"http://127.0.0.1:{port}"
