"""`python manage.py demo`: the whole system on one machine, on its embedded default."""

import json
import os
import secrets
import signal
import sys
import time
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError, close_old_connections

from console import actions as console_actions
from console import celery_app, database
from console.models import ApiToken
from console.stack import (
    Child,
    StackError,
    Supervisor,
    free_port,
    port_in_use,
    python,
    start_embedded_postgres,
    start_embedded_redis,
    wait_http,
)
from recovery import roles, tasks
from recovery.actions import capacity, cluster_settings, keys, moe, routing, streams
from recovery.choices import NodeState, Tier
from recovery.models import ApiKey, Cluster, HistoryBackfill, ModelCapacity, Node, key_digest
from recovery.policy import moe as moe_policy
from workers import catalog
from workers.moe import expert_bytes

# Stopped in turn, each group waited for: the load and the control plane's periodic work first (a capacity check
# that saw the nodes deregister would raise the level, an incident at every stop), then the gateways and the nodes
# (they deregister through web and Redis), then everything else.
STOP_FIRST = ["traffic", "beat", "worker"]
BEAT_SILENT_S = 30.0  # a beat that has not ticked for this long is stuck: killed and started again


def stop_phases(children: list[str]) -> list[list[str]]:
    """The groups `Supervisor.stop` stops in turn, before everything else, for a stack of these children."""
    gateways = [n for n in children if n.startswith("gateway")]
    nodes = [n for n in children if n.startswith("node-")]
    traffic = [n for n in children if n.startswith("traffic-")]  # one per served model after the first
    return [traffic + STOP_FIRST, gateways + nodes]


class Command(BaseCommand):
    help = "Start Lifeline on this machine: Redis, web, Celery worker and beat, gateway, emulated nodes and traffic."

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1", help="address every server binds (default: loopback only)")
        parser.add_argument("--port", type=int, default=8000, help="console (web) port")
        parser.add_argument("--gateway-port", type=int, default=8100, help="gateway port")
        parser.add_argument(
            "--gateways",
            type=int,
            default=1,
            help="gateway processes sharing the routing table, on --gateway-port and the ports after it",
        )
        parser.add_argument("--nodes", type=int, default=8, help="emulated serving nodes to start")
        parser.add_argument(
            "--spares",
            type=int,
            default=1,
            help="hot spares to start beside them (hold the model, take no traffic until promoted)",
        )
        parser.add_argument("--racks", type=int, default=2)
        parser.add_argument(
            "--model",
            default="Qwen3-32B",
            help="the served model, or several separated by commas: each gets --nodes nodes, --spares hot spares "
            "and its own traffic (catalog keys)",
        )
        parser.add_argument("--gpus", default="H100-SXM,H200-SXM", help="GPU type per rack, cycled (catalog keys)")
        parser.add_argument(
            "--providers",
            default="",
            help="provider:region per rack, cycled, e.g. eu-cloud:eu-west,us-cloud:us-east (default: none said); "
            "API keys can then be restricted to some of them on the keys page",
        )
        parser.add_argument(
            "--tp", type=int, default=2, choices=catalog.TP_DEGREES, help="tensor-parallel degree of each node"
        )
        parser.add_argument(
            "--moe",
            action="store_true",
            help=f"also serve {MOE_MODEL} decoupled (document 001): {MOE_EWS} expert workers holding its experts with "
            f"shadows and a standby one, and {MOE_AWS} attention workers routed by the gateway beside the other nodes",
        )
        parser.add_argument(
            "--moe-aws",
            type=int,
            default=MOE_AWS,
            help=f"attention workers of the --moe deployment (default {MOE_AWS})",
        )
        parser.add_argument(
            "--moe-ews",
            type=int,
            default=MOE_EWS,
            help=f"expert workers of the --moe deployment, besides its standby (default {MOE_EWS})",
        )
        parser.add_argument(
            "--moe-no-shadows",
            action="store_true",
            help="the --moe deployment's experts have no shadows: an EW lost stalls its experts until the standby "
            "serves them (benchmarks.moe_fleet --no-shadows measures that stall)",
        )
        parser.add_argument(
            "--moe-static-binding",
            action="store_true",
            help="the --moe attention workers bind each expert to one EW for good, without the routing table's "
            "failover (a baseline for benchmarks.moe_fleet, not a way to serve)",
        )
        parser.add_argument("--no-traffic", action="store_true", help="do not start the traffic generator")
        parser.add_argument(
            "--no-history",
            action="store_true",
            help="do not back-fill 30 days of generated (simulated) history on the first start; it is made from the "
            "traffic, so --no-traffic implies it",
        )
        parser.add_argument("--rate", type=float, default=6.0, help="traffic: mean requests per second")
        parser.add_argument(
            "--time-scale", type=float, default=1.0, help="multiplies emulated GPU time; 1 is real time"
        )
        parser.add_argument(
            "--restart-delay",
            type=float,
            default=10.0,
            help="seconds before a node that died is started again; negative: never",
        )
        parser.add_argument("--worker-concurrency", type=int, default=2)

    def handle(self, *args, **opts):
        self.opts = opts
        self._check(opts)
        var_dir = settings.VAR_DIR
        var_dir.mkdir(parents=True, exist_ok=True)
        self.demo_file = var_dir / "demo.json"
        self.supervisor = Supervisor(var_dir / "log")
        self.stopping = False
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        try:
            self._run(opts, var_dir)
        except (StackError, database.DatabaseError) as exc:
            raise CommandError(str(exc)) from None
        except KeyboardInterrupt:
            pass
        finally:
            self.stdout.write("Stopping Lifeline…")
            self.supervisor.stop(order=stop_phases(list(self.supervisor.children)))
            close_old_connections()
            self.stdout.write("Stopped: no process left running.")

    def _on_signal(self, signum, frame):
        if self.stopping:
            return
        self.stopping = True
        raise KeyboardInterrupt

    def _check(self, opts):
        if opts["nodes"] < 0 or opts["racks"] < 1:
            raise CommandError("--nodes must be 0 or more and --racks at least 1")
        if opts["time_scale"] <= 0:
            raise CommandError("--time-scale must be positive")
        if opts["moe"] and (opts["moe_aws"] < 1 or opts["moe_ews"] < 2):
            raise CommandError("--moe needs at least 1 attention worker (--moe-aws) and 2 expert workers (--moe-ews)")
        gpus = [g.strip() for g in opts["gpus"].split(",") if g.strip()]
        models = [m.strip() for m in opts["model"].split(",") if m.strip()]
        for model in models:
            if model not in catalog.MODELS or catalog.MODELS[model].is_draft:
                served = ", ".join(k for k, m in catalog.MODELS.items() if not m.is_draft)
                raise CommandError(f"--model: {model!r} is not a catalog model a node can serve: one of {served}")
        if not models or len(set(models)) != len(models):
            raise CommandError("--model: name each served model once, separated by commas")
        for model in models:
            for gpu in gpus:
                try:
                    catalog.Deployment.of(model, gpu, opts["tp"])
                except catalog.CatalogError as exc:
                    raise CommandError(f"--gpus/--tp: {exc}") from None
        opts["gpu_list"], opts["models"] = gpus, models
        opts["provider_list"] = []
        for item in (p.strip() for p in opts["providers"].split(",") if p.strip()):
            provider, _, region = item.partition(":")
            if not keys.NAME.match(provider) or (region and not keys.NAME.match(region)):
                raise CommandError(f"--providers: {item!r} is not provider:region (names: letters, digits, . _ -)")
            opts["provider_list"].append((provider, region))
        if not 1 <= opts["gateways"] <= 16:
            raise CommandError("--gateways must be between 1 and 16")
        ports = [(opts["port"], "--port")]
        ports += [(opts["gateway_port"] + i, "--gateway-port (and --gateways)") for i in range(opts["gateways"])]
        for port, option in ports:
            if port_in_use(opts["host"], port):
                raise CommandError(
                    f"port {port} on {opts['host']} is in use (another Lifeline, or another server): "
                    f"stop it, or choose another port with {option}"
                )

    # ------------------------------------------------------------------------------------
    def _run(self, opts, var_dir: Path):
        host = opts["host"]
        started, started_at = time.monotonic(), time.time()
        redis_url = settings.REDIS_URL
        if redis_url:
            self.stdout.write(f"Using the Redis at REDIS_URL ({_redact(redis_url)}).")
        else:
            redis_url = start_embedded_redis(self.supervisor, var_dir / "redis")
            settings.REDIS_URL = redis_url  # this process publishes keys and routing too
            self.stdout.write(f"Started an embedded Redis at {redis_url}.")
        self.database_url = os.environ.get("DATABASE_URL")
        if not self.database_url:
            self.database_url = start_embedded_postgres(self.supervisor, database.data_dir(var_dir))
        self.stdout.write(f"Database: {_describe_db()}; migrating…")
        call_command("migrate", interactive=False, verbosity=0)

        previous = _read_json(self.demo_file)
        logins = self._demo_users(previous)
        api_token = self._api_token(previous)
        gateway_keys = self._gateway_keys(previous)
        gateway_key = gateway_keys[Tier.STANDARD]
        node_token = settings.LIFELINE_NODE_TOKEN or previous.get("node_token") or secrets.token_urlsafe(24)
        agent_token = os.environ.get("LIFELINE_AGENT_TOKEN") or previous.get("agent_token") or secrets.token_urlsafe(24)
        fault_token = os.environ.get("LIFELINE_FAULT_TOKEN") or previous.get("fault_token") or secrets.token_urlsafe(24)
        # The demo is a rehearsal cluster: operators may inject faults from the console.
        Cluster.objects.filter(pk=Cluster.default().pk).update(fault_injection_enabled=True)
        # A start is not an emergency: the fleet that joins is not a capacity loss, and the level left from the
        # last run is evaluated afresh, before the gateway reads it.
        capacity.control_plane_started()
        routing.sync_hot_state()

        web_url = f"http://{host}:{opts['port']}"
        gateway_url = f"http://{host}:{opts['gateway_port']}"
        env = self._child_env(redis_url, node_token, agent_token, fault_token)
        web = self.supervisor.spawn(
            Child(
                "web",
                [python(), "-m", "daphne", "-b", host, "-p", str(opts["port"]), "-v", "0", "console.asgi:application"],
                env,
                restart_delay_s=2,
            )
        )
        worker = [
            python(),
            "-m",
            "celery",
            "-A",
            "console",
            "worker",
            "-l",
            "INFO",
            "-c",
            str(opts["worker_concurrency"]),
            "-n",
            f"worker-{settings.LIFELINE_NAMESPACE}@%h",
            "--without-gossip",
            "--without-mingle",
        ]
        self.supervisor.spawn(Child("worker", worker, env, restart_delay_s=2, term_leader_only=True))
        alive = Path(settings.VAR_DIR) / "beat.alive"  # console/beat.py touches it at every tick
        self.supervisor.spawn(
            Child(
                "beat",
                [python(), "-m", "celery", "-A", "console", "beat", "-l", "INFO", "--pidfile="],
                {**env, "LIFELINE_BEAT_ALIVE_FILE": str(alive)},
                restart_delay_s=2,
                alive_file=alive,
                alive_within_s=BEAT_SILENT_S,
            )
        )
        gateways = []
        for i in range(opts["gateways"]):
            port = opts["gateway_port"] + i
            argv = [python(), "manage.py", "gateway", "--host", host, "--port", str(port), "--name", f"gateway-{i + 1}"]
            name = "gateway" if i == 0 else f"gateway-{i + 1}"
            gateways.append((f"http://{host}:{port}", self.supervisor.spawn(Child(name, argv, env, restart_delay_s=2))))
        wait_http(f"{web_url}/healthz", 60, web, self.supervisor)
        for url, child in gateways:
            wait_http(f"{url}/healthz", 60, child, self.supervisor)

        restart = opts["restart_delay"] if opts["restart_delay"] >= 0 else None
        per_model = opts["nodes"] + opts["spares"]
        total = per_model * len(opts["models"])
        for n in range(total):
            # Each model's nodes spread over the racks the same way, its spares after them.
            model, i = opts["models"][n // per_model], n % per_model
            rack_index = min(i, opts["nodes"] - 1) * opts["racks"] // max(opts["nodes"], 1)
            argv = [
                python(),
                "-m",
                "workers.node",
                "--name",
                f"node-{n + 1:02d}",
                "--rack",
                f"rack-{chr(ord('a') + rack_index)}",
                "--model",
                model,
                "--gpu",
                opts["gpu_list"][rack_index % len(opts["gpu_list"])],
                "--tp",
                str(opts["tp"]),
                "--host",
                host,
                "--port",
                "0",
                "--control-url",
                web_url,
                "--time-scale",
                str(opts["time_scale"]),
                "--enable-faults",
                # A node switched to another model (a re-placement) comes back on it after a crash.
                "--state-file",
                str(var_dir / "nodes" / f"node-{n + 1:02d}.json"),
            ] + (["--spare"] if i >= opts["nodes"] else [])
            if opts["provider_list"]:
                provider, region = opts["provider_list"][rack_index % len(opts["provider_list"])]
                argv += ["--provider", provider] + (["--region", region] if region else [])
            # The fleet is already up when the demo opens; a node that crashed reloads its model
            # from disk (draft first), as a real one would.
            self.supervisor.spawn(
                Child(
                    f"node-{n + 1:02d}",
                    argv + ["--start", "warm"],
                    env,
                    restart_delay_s=restart,
                    restart_argv=argv + ["--start", "cold"],
                )
            )
        if opts["moe"]:
            total += self._start_moe(host, web_url, env, var_dir, restart)
        self._wait_nodes_serving(total, 60 + 2 * total)  # a big fleet takes a while to start on a small machine
        self._wait_control_plane(started_at, 60)
        self._set_objectives(opts)
        history = self._backfill_history(opts)

        if not opts["no_traffic"]:
            traffic_env = {
                **env,
                "LIFELINE_GATEWAY_KEY": ",".join(gateway_keys.values()),
            }  # premium, standard and best-effort
            for i, model in enumerate(opts["models"] + ([MOE_MODEL] if opts["moe"] else [])):
                argv = [
                    python(),
                    "-m",
                    "workers.traffic",
                    "--gateway",
                    gateway_url,
                    "--model",
                    model,
                    "--rate",
                    # Every layer of an attention worker's step is a round trip to the expert workers: its traffic
                    # is lighter, so that the machine keeps up with the dense fleet beside it.
                    str(opts["rate"] if model != MOE_MODEL else min(opts["rate"], MOE_RATE)),
                ]
                name = "traffic" if i == 0 else f"traffic-{i + 1}"
                self.supervisor.spawn(Child(name, argv, traffic_env, restart_delay_s=5))

        self.info = {
            "urls": {
                "console": f"{web_url}/",
                "cluster": f"{web_url}/cluster/",
                "api_cluster": f"{web_url}/api/cluster",
                "admin": f"{web_url}/admin/",
                "gateway": f"{gateway_url}/v1",
                "gateways": [f"{url}/v1" for url, _ in gateways],
            },
            "logins": logins,
            "api_token": api_token,
            "api_token_user": "admin",
            "gateway_key": gateway_key,
            "gateway_keys": gateway_keys,
            "node_token": node_token,
            "agent_token": agent_token,
            "fault_token": fault_token,
            "redis_url": redis_url,
            "database": _describe_db(),
            "log_dir": str(self.supervisor.log_dir),
            "traffic": None if opts["no_traffic"] else {"rate": opts["rate"]},
            "history": history,
        }
        self._write_info()
        self._banner(time.monotonic() - started)
        ticks = 0
        while True:
            time.sleep(0.5)
            ticks += 1
            for child in self.supervisor.poll():
                self.stdout.write(f"restarted {child.name} (pid {child.pid})")
            if ticks % 2 == 0:
                self._write_info()  # a restarted node has a new pid, and a new address once it registers

    def _child_env(self, redis_url: str, node_token: str, agent_token: str, fault_token: str) -> dict:
        env = dict(os.environ)
        env.update(
            {
                "DJANGO_SETTINGS_MODULE": "console.settings",
                "DATABASE_URL": self.database_url,
                "REDIS_URL": redis_url,
                "LIFELINE_VAR_DIR": str(settings.VAR_DIR),
                "LIFELINE_NAMESPACE": settings.LIFELINE_NAMESPACE,
                "LIFELINE_NODE_TOKEN": node_token,
                "LIFELINE_AGENT_TOKEN": agent_token,
                "LIFELINE_FAULT_TOKEN": fault_token,
                "PYTHONUNBUFFERED": "1",
            }
        )
        return env

    def _start_moe(self, host: str, web_url: str, env: dict, var_dir: Path, restart: float | None) -> int:
        """The MoE deployment: expert workers on ports of their own (a restarted one comes back on its port and
        loads its experts cold), the table planned for them (recovery.policy.moe), and attention workers that are
        nodes like the others. Returns how many nodes it started."""
        model = catalog.MODELS[MOE_MODEL]
        room = moe_policy.ExpertWorker
        ews, aw_count = self.opts["moe_ews"], self.opts["moe_aws"]
        table = moe_policy.plan(
            model,
            [room(f"ew-{i + 1}", expert_bytes(model) * 4) for i in range(ews)],
            shadows=not self.opts["moe_no_shadows"],
        )
        first = free_port(host, ews + 1)
        addresses, standby = {}, f"ew-{ews + 1}"
        for i, ew in enumerate([*sorted(table.ews()), standby]):
            url = f"http://{host}:{first + i}"
            argv = [python(), "-m", "workers.expert_worker", "--name", ew, "--model", MOE_MODEL, "--host", host]
            argv += ["--port", str(first + i), "--time-scale", str(self.opts["time_scale"]), "--enable-faults"]
            argv += ["--experts", ",".join(map(str, table.primaries_of(ew)))]
            argv += ["--shadows", ",".join(map(str, table.shadows_of(ew)))]
            child = self.supervisor.spawn(
                Child(ew, argv, env, restart_delay_s=2, restart_argv=argv + ["--start", "cold"])
            )
            wait_http(f"{url}/health", 30, child, self.supervisor)
            addresses[ew] = url
        ert = var_dir / "moe" / "ert.json"
        ert.parent.mkdir(parents=True, exist_ok=True)
        ert.write_text(json.dumps(table.to_json()))
        aws = [f"node-aw{i + 1}" for i in range(aw_count)]
        # The control plane owns the table from here: it watches the EWs, heals the table when one is lost and
        # provisions the standby in its place (recovery.actions.moe).
        moe.register(
            MOE_DEPLOYMENT,
            MOE_MODEL,
            {ew: addresses[ew] for ew in table.ews()},
            aws,
            table,
            {standby: addresses[standby]},
        )
        for i, name in enumerate(aws):
            argv = [python(), "-m", "workers.node", "--name", name, "--rack", f"rack-{chr(ord('a') + i % 2)}"]
            argv += ["--model", MOE_MODEL, "--gpu", "H200-SXM", "--tp", "1", "--host", host, "--port", "0"]
            argv += ["--control-url", web_url, "--time-scale", str(self.opts["time_scale"]), "--enable-faults"]
            argv += ["--expert-workers", ",".join(f"{ew}={addresses[ew]}" for ew in sorted(table.ews()))]
            argv += ["--ert", str(ert)]
            if self.opts["moe_static_binding"]:
                argv += ["--expert-binding", "static"]
            self.supervisor.spawn(
                Child(
                    name,
                    argv + ["--start", "warm"],
                    env,
                    restart_delay_s=restart,
                    restart_argv=argv + ["--start", "cold"],
                )
            )
        return aw_count

    def _wait_control_plane(self, since: float, timeout_s: float):
        """Ready means the control plane acts too: a Celery worker has read the gateways' reports since this start
        (a stack announced before its worker was up left a first failure unhandled for seconds)."""
        deadline = time.monotonic() + timeout_s
        while not streams.read_since(since):
            for name in ("worker", "beat"):
                if self.supervisor.exited(name):
                    raise StackError(
                        f"the Celery {name} exited while starting: see {self.supervisor.children[name].log_path}"
                    )
            if time.monotonic() > deadline:
                raise StackError(
                    f"the Celery worker read nothing the gateways reported in {timeout_s:.0f} s: see the worker's and "
                    f"beat's logs in {self.supervisor.log_dir}"
                )
            time.sleep(0.2)

    def _wait_nodes_serving(self, count: int, timeout_s: float):
        names = [n for n in self.supervisor.children if n.startswith("node-")]
        deadline = time.monotonic() + timeout_s
        while True:
            serving = set(Node.objects.filter(name__in=names, state=NodeState.SERVING).values_list("name", flat=True))
            if len(serving) >= count:
                return
            for name in names:
                if self.supervisor.exited(name):
                    raise StackError(f"{name} exited while starting: see {self.supervisor.children[name].log_path}")
            if time.monotonic() > deadline:
                missing = sorted(set(names) - serving)
                raise StackError(
                    f"nodes not serving after {timeout_s:.0f} s: {', '.join(missing)}; see {self.supervisor.log_dir}"
                )
            time.sleep(0.2)

    def _nodes_info(self) -> list[dict]:
        rows = {n.name: n for n in Node.objects.select_related("rack")}
        info = []
        for name, child in self.supervisor.children.items():
            if not name.startswith("node-"):
                continue
            node = rows.get(name)
            info.append(
                {
                    "name": name,
                    "pid": child.pid,
                    "address": node.address if node else None,
                    "rack": node.rack.name if node else None,
                    "command": child.argv,
                }
            )
        return info

    def _write_info(self):
        info = dict(self.info)
        try:
            info["nodes"] = self._nodes_info()
        except DatabaseError as exc:
            # The database went away (restarted, cut off): the supervisor carries on, with the last addresses known.
            close_old_connections()
            info["nodes"] = getattr(self, "_written", {}).get("nodes", [])
            if not getattr(self, "_db_gone", False):
                self.stdout.write(f"database unreachable; node addresses in demo.json kept: {exc}".splitlines()[0])
            self._db_gone = True
        else:
            self._db_gone = False
        info["pids"] = {name: child.pid for name, child in self.supervisor.children.items()}
        close_old_connections()
        if info == getattr(self, "_written", None):
            return
        self._written = info
        tmp = self.demo_file.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it holds passwords and tokens
        with os.fdopen(fd, "w") as handle:
            json.dump(info, handle, indent=2)
        os.replace(tmp, self.demo_file)

    def _banner(self, took_s: float):
        urls = self.info["urls"]
        logins = "   ".join(f"{item['username']} / {item['password']}" for item in self.info["logins"])
        traffic = "off" if self.opts["no_traffic"] else f"{self.opts['rate']:g} req/s"
        lines = [
            "",
            f"Lifeline is running ({took_s:.0f} s to start).",
            f"  Console   {urls['cluster']}",
            f"  Logins    {logins}",
            f"  API       {urls['api_cluster']}    Authorization: Bearer {self.info['api_token']}",
            f"  Gateway   {urls['gateway']}    Authorization: Bearer {self.info['gateway_key']}",
            f"  Nodes     {self.opts['nodes']} emulated {' and '.join(self.opts['models'])} nodes in "
            f"{self.opts['racks']} racks, {self.opts['spares']} hot spare(s)"
            + (" each" if len(self.opts["models"]) > 1 else "")
            + f"; traffic {traffic}"
            + (" per model" if len(self.opts["models"]) > 1 and not self.opts["no_traffic"] else ""),
            *(
                [
                    f"  MoE       {MOE_MODEL} decoupled: {self.opts['moe_aws']} attention workers (node-aw1…) behind "
                    f"the gateway, {self.opts['moe_ews']} expert workers (ew-1…) with every expert shadowed, "
                    f"ew-{self.opts['moe_ews'] + 1} standing by; "
                    f"/moe/ shows them"
                ]
                if self.opts["moe"]
                else []
            ),
            f"  History   {self.info['history']}",
            f"  Details   {self.demo_file}    logs in {self.supervisor.log_dir}",
            f"  E-mail    {_mail_destination()}",
            "Press Ctrl-C to stop.",
            "",
        ]
        self.stdout.write("\n".join(lines))
        sys.stdout.flush()

    # --- demo accounts -------------------------------------------------------------------
    def _demo_users(self, previous: dict) -> list[dict]:
        known = {item["username"]: item["password"] for item in previous.get("logins", []) if "username" in item}
        logins = []
        for role in roles.ROLES:
            password = known.get(role) or f"{role}-{secrets.token_urlsafe(6)}"
            # An address each, so on-call e-mail is written to var/mail/ (the file backend) for the demo to show.
            console_actions.set_user_role(
                role, role, email=f"{role}@lifeline.localhost", password=password, actor="demo"
            )
            logins.append({"role": role, "username": role, "password": password})
        return logins

    def _api_token(self, previous: dict) -> str:
        token = previous.get("api_token")
        if token and ApiToken.authenticate(token) is not None:
            return token
        _, token = ApiToken.issue(get_user_model().objects.get(username="admin"), "demo")
        return token

    def _gateway_keys(self, previous: dict) -> dict[str, str]:
        """One demo key per tier, kept across runs: the traffic mixes them, so shedding shows."""
        known = previous.get("gateway_keys") or {Tier.STANDARD: previous.get("gateway_key")}
        by_tier = {}
        for tier in Tier.values:
            key = known.get(tier)
            if not (key and ApiKey.objects.filter(digest=key_digest(key), revoked_at__isnull=True).exists()):
                _, key = keys.create_api_key(f"demo-{tier.replace('_', '-')}", tier, "demo traffic", actor="demo")
            by_tier[tier] = key
        return by_tier

    def _backfill_history(self, opts) -> str:
        """On the first start, 30 days of generated history in the background (recovery.actions.history): made from
        this fleet, its keys and the traffic model, ending now, before the traffic starts. Once: the task records its
        run and resumes one cut short; a later start finds it done and adds nothing."""
        if opts["no_traffic"] or opts["no_history"]:
            return "off"
        run = HistoryBackfill.objects.first()
        if run is not None and run.finished_at is not None:
            return f"{run.days} days generated {run.window_start:%Y-%m-%d} to {run.window_end:%Y-%m-%d %H:%M} UTC"
        celery_app.conf.broker_url = settings.REDIS_URL  # the Redis of this run (embedded or not), as the worker's
        tasks.backfill_history.delay(time.time())
        return "30 days of generated (simulated) history being written in the background"

    def _set_objectives(self, opts):
        """A throughput objective the fleet meets with room to spare, unless an admin has set one, set once every
        node serves: OBJECTIVE_SHARE of what the nodes in service carry (the hot spare not counted)."""
        set_demo_objective(Cluster.default())


# --moe: the decoupled MoE deployment beside the dense fleet.
MOE_MODEL = "Mixtral-8x7B"
MOE_DEPLOYMENT = "mixtral-moe"
MOE_EWS = 4  # each with room for four experts: two primaries and two shadows, every expert shadowed
MOE_AWS = 2
MOE_RATE = 1.0  # requests per second of its traffic, at most


# The README's walk-through with the default fleet (eight nodes, H100 and H200 racks, one H200 spare): losing one
# node is covered by the spare; losing two (the spare takes one's place) shows level 1 whichever two; killing four
# at once shows level 2, where best-effort traffic gets 429. tests/console/test_demo_walkthrough.py follows it.
OBJECTIVE_SHARE = 0.92


def set_demo_objective(cluster: Cluster) -> dict[str, float]:
    """For each served model without a throughput objective, OBJECTIVE_SHARE of what its nodes in service carry.
    Returns {model: required} of those set."""
    set_ = {}
    for model in capacity.served_models(cluster):
        if ModelCapacity.of(model, cluster).required_rps > 0:
            continue
        report = capacity.report(cluster, model=model)
        if report.capacity_rps <= 0:
            continue
        required = round(OBJECTIVE_SHARE * report.capacity_rps, 1)
        cluster_settings.update_model(
            cluster,
            model,
            {"required_rps": required},
            "demo",
            f"{OBJECTIVE_SHARE:.0%} of what the demo's {report.in_service} {model} nodes in service carry: losing two "
            "shows level 1 (the spare replaces one), losing four level 2",
        )
        set_[model] = required
    return set_


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _mail_destination() -> str:
    """Where on-call e-mail goes: files in var/mail/ unless LIFELINE_EMAIL_BACKEND names another backend."""
    if settings.EMAIL_BACKEND.endswith("filebased.EmailBackend"):
        return f"on-call mail is written to {settings.EMAIL_FILE_PATH}/"
    return f"on-call mail is sent by {settings.EMAIL_BACKEND}"


def _describe_db() -> str:
    db = settings.DATABASES["default"]
    if db["ENGINE"].endswith("sqlite3"):
        return f"SQLite at {db['NAME']}"
    if not os.environ.get("DATABASE_URL"):
        return f"the embedded PostgreSQL, database {db['NAME']} in {db['HOST']}"
    where = db["HOST"] if db["HOST"].startswith("/") else f"{db['HOST']}:{db['PORT']}"
    return f"PostgreSQL {db['NAME']} at {where}"


def _redact(url: str) -> str:
    if "@" in url:
        scheme, _, rest = url.partition("://")
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url
