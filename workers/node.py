"""Run one serving node: `python -m workers.node --name node-01 --rack rack-a`.

The node binds its agent (port 0 picks a free one), prints one JSON line with
its address and pid, loads its model (the draft first, then the full model),
registers with the control plane and sends heartbeats until SIGTERM or
SIGINT, when it tells the control plane it is leaving.

With --engine-url the node fronts a real engine (workers.adapter) instead of
emulating one; the agent, its runtime and its HTTP face are the same.

Secrets come from the environment, never the command line:
LIFELINE_NODE_TOKEN (to register), LIFELINE_AGENT_TOKEN (control endpoints:
checkpoints, migration, assist, reload, batch limit, GPU reset),
LIFELINE_FAULT_TOKEN (fault injection, only with --enable-faults).
"""

import argparse
import asyncio
import gc
import json
import logging
import os
import signal
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import cast

from aiohttp import web

from workers import catalog, protocol
from workers.adapter import DIALECTS, AdapterEngine, EngineMismatch
from workers.agent import build_app, offered_capabilities
from workers.checkpoint import CheckpointStreamer
from workers.control import ControlPlaneLink
from workers.engine import Engine
from workers.engine_api import EngineConfig, ServingEngine
from workers.engine_process import EngineProcess, EngineStartError, default_reset_command
from workers.faults import FaultState
from workers.kvstore import CheckpointStore
from workers.moe import ExpertRoutingTable
from workers.refe import ExpertPath
from workers.runtime import Identity, NodeRuntime
from workers.telemetry import DcgmCollector, HeartbeatTelemetry, emulated_gpus, open_telemetry

log = logging.getLogger("workers.node")

GIB = 1024**3


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes", "on")


def parse_args(argv=None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(
        prog="python -m workers.node",
        description="Run one Lifeline serving node: the emulated GPU engine, or a real one at --engine-url.",
    )
    parser.add_argument(
        "--name", default=env("LIFELINE_NODE_NAME", socket.gethostname()), help="node name, unique in the cluster"
    )
    parser.add_argument("--rack", default=env("LIFELINE_NODE_RACK", "rack-a"))
    parser.add_argument(
        "--server",
        default=env("LIFELINE_NODE_SERVER", ""),
        help="the machine whose PCIe bus this node's GPUs share with other nodes' (default: one of its own); "
        "KV between nodes of one server moves over PCIe",
    )
    parser.add_argument(
        "--nvl-domain",
        default=env("LIFELINE_NODE_NVL_DOMAIN", ""),
        help="the NVLink domain its GPUs belong to, e.g. a DGX's eight GPUs or an NVL72 rack "
        "(default: none shared with other nodes); KV inside one domain moves over NVLink",
    )
    parser.add_argument(
        "--network",
        choices=catalog.NETWORKS,
        default=env("LIFELINE_NODE_NETWORK", "infiniband"),
        help="the network between servers and racks (default infiniband)",
    )
    parser.add_argument(
        "--provider",
        default=env("LIFELINE_NODE_PROVIDER", ""),
        help="who runs this machine (a cloud, a colocation, on-premises); an API key restricted to trusted providers "
        "is served only on theirs",
    )
    parser.add_argument(
        "--region",
        default=env("LIFELINE_NODE_REGION", ""),
        help="where this machine is (e.g. eu-west); an API key restricted to regions, for data residency, is served "
        "only in them",
    )
    parser.add_argument("--model", default=env("LIFELINE_NODE_MODEL", "Qwen3-32B"), choices=sorted(catalog.MODELS))
    parser.add_argument("--gpu", default=env("LIFELINE_NODE_GPU", "H100-SXM"), choices=sorted(catalog.GPUS))
    parser.add_argument("--tp", type=int, default=int(env("LIFELINE_NODE_TP", "1")), choices=catalog.TP_DEGREES)
    parser.add_argument("--host", default=env("LIFELINE_NODE_HOST", "127.0.0.1"), help="address to bind")
    parser.add_argument(
        "--port", type=int, default=int(env("LIFELINE_NODE_PORT", "0")), help="port to bind; 0 picks a free one"
    )
    parser.add_argument(
        "--advertise-host",
        default=env("LIFELINE_NODE_ADVERTISE_HOST"),
        help="host other machines reach this node at (default: --host)",
    )
    parser.add_argument(
        "--control-url",
        default=env("LIFELINE_CONTROL_URL"),
        help="base URL of the Lifeline console, e.g. http://127.0.0.1:8000",
    )
    parser.add_argument("--heartbeat-interval", type=float, default=float(env("LIFELINE_HEARTBEAT_INTERVAL_S", "1.0")))
    parser.add_argument(
        "--time-scale",
        type=float,
        default=float(env("LIFELINE_TIME_SCALE", "1.0")),
        help="multiplies emulated GPU time; 0.5 runs twice as fast",
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=int(env("LIFELINE_MAX_NUM_SEQS", "128")), help="batch limit"
    )
    parser.add_argument(
        "--start",
        choices=("cold", "warm"),
        default=env("LIFELINE_NODE_START", "cold"),
        help="cold: load the draft model, then the full model (as after a restart); warm: serve at once",
    )
    parser.add_argument(
        "--host-memory-gb", type=float, default=None, help="host DRAM (default: twice the GPUs' memory)"
    )
    parser.add_argument(
        "--checkpoint-budget",
        type=float,
        default=float(env("LIFELINE_CHECKPOINT_BUDGET", "0.05")),
        help="share of host memory for other nodes' KV checkpoints (default 0.05)",
    )
    parser.add_argument("--kv-wire-scale", type=float, default=1 / 4096, help="bytes moved per byte of KV accounted")
    parser.add_argument(
        "--draft-agreement",
        type=float,
        default=None,
        help="for experiments: the draft model's per-token agreement with the target, a modelled parameter "
        "(default: the catalog's for the model pair)",
    )
    parser.add_argument(
        "--enable-faults",
        action="store_true",
        default=_env_flag("LIFELINE_FAULTS_ENABLED"),
        help="allow fault injection at /agent/faults (with LIFELINE_FAULT_TOKEN); staging only",
    )
    parser.add_argument(
        "--spare",
        action="store_true",
        default=_env_flag("LIFELINE_NODE_SPARE"),
        help=(
            "join as a hot spare: load the model and answer canaries, "
            "but take no traffic until the control plane promotes it"
        ),
    )
    parser.add_argument(
        "--engine-url",
        default=env("LIFELINE_ENGINE_URL"),
        help="front a real engine (vLLM, SGLang or llama.cpp's llama-server) at this URL instead of emulating one",
    )
    parser.add_argument(
        "--engine-kind",
        choices=("auto", *DIALECTS),
        default=env("LIFELINE_ENGINE_KIND", "auto"),
        help="the engine at --engine-url; auto: told by its /metrics series (default)",
    )
    parser.add_argument(
        "--engine-model",
        default=env("LIFELINE_ENGINE_MODEL"),
        help="the name the engine serves the model under (its /v1/models), when not the catalog's name",
    )
    parser.add_argument(
        "--engine-wait",
        type=float,
        default=float(env("LIFELINE_ENGINE_WAIT_S", "900")),
        help="seconds to wait for the engine to load its model before giving up (default 900)",
    )
    parser.add_argument(
        "--engine-command",
        default=env("LIFELINE_ENGINE_COMMAND"),
        help="with --engine-url: the command that starts the engine; the node then owns its process: starts it, "
        "starts it again when it dies, stops it with itself, and offers reload (the engine's graceful shutdown "
        "and a fresh start) and GPU reset (workers.engine_process)",
    )
    parser.add_argument(
        "--engine-log",
        default=env("LIFELINE_ENGINE_LOG"),
        help="with --engine-command: the file the engine's output is appended to (default: discarded)",
    )
    parser.add_argument(
        "--engine-stop-timeout",
        type=float,
        default=float(env("LIFELINE_ENGINE_STOP_TIMEOUT_S", "30")),
        help="with --engine-command: seconds the engine gets after SIGTERM to shut down before SIGKILL (default 30)",
    )
    parser.add_argument(
        "--gpu-reset-command",
        default=env("LIFELINE_GPU_RESET_COMMAND"),
        help="with --engine-command: how to reset this node's GPUs while the engine is stopped, {gpus} replaced by "
        "their indices (default: nvidia-smi --gpu-reset -i {gpus}, offered where NVML sees GPUs, nvidia-smi is "
        "installed and the node runs as root; elsewhere no reset is offered)",
    )
    parser.add_argument(
        "--expert-workers",
        default=env("LIFELINE_EXPERT_WORKERS", ""),
        help="an MoE attention worker: its expert workers as name=URL, comma-separated (with --ert); every layer's "
        "experts run there (document 001)",
    )
    parser.add_argument(
        "--ert", default=env("LIFELINE_ERT", ""), help="the expert routing table to start with (a JSON file)"
    )
    parser.add_argument(
        "--expert-wait",
        type=float,
        default=float(env("LIFELINE_EXPERT_WAIT_S", "30")),
        help="seconds a step waits on an expert with no live location (for the control plane's next table, or an "
        "EW back) before its requests fail and are resumed elsewhere by the gateway (default 30)",
    )
    parser.add_argument(
        "--expert-binding",
        choices=["table", "static"],
        default="table",
        help="table (default): experts resolved through the expert routing table, with data-path probing, failover "
        "to shadows and the control plane's updates; static: each expert bound to its first primary for good, "
        "none of that (the baseline benchmarks.moe_fleet measures the table against)",
    )
    parser.add_argument(
        "--state-file",
        default=env("LIFELINE_NODE_STATE_FILE", ""),
        help="where the node keeps the model a switch (POST /agent/model) left it serving, so that a supervisor "
        "that starts it again with its first command line after a crash gets that model, not the first one "
        "(default: none kept)",
    )
    parser.add_argument(
        "--park-grace",
        type=float,
        default=float(env("LIFELINE_PARK_GRACE_S", "20")),
        help="seconds a gateway's request whose stream broke is held, still generating, for a gateway to take it "
        "over (a client resuming with Last-Event-ID); 0 aborts it at once (default 20)",
    )
    parser.add_argument("--log-level", default=env("LIFELINE_LOG_LEVEL", "INFO"))
    args = parser.parse_args(argv)
    if args.park_grace < 0:
        parser.error("--park-grace must be 0 or more")
    if args.time_scale <= 0:
        parser.error("--time-scale must be positive")
    if args.network not in catalog.NETWORKS:  # from LIFELINE_NODE_NETWORK, which argparse does not check
        parser.error(f"--network {args.network!r} is not a network: expected one of {', '.join(catalog.NETWORKS)}")
    if args.nvl_domain and catalog.GPUS[args.gpu].link == "pcie":
        parser.error(f"--nvl-domain needs GPUs with NVLink: the {args.gpu} connects over PCIe only")
    if not 0 < args.checkpoint_budget <= 0.5:
        parser.error("--checkpoint-budget must be a share of host memory in (0, 0.5]")
    if args.expert_wait <= 0:
        parser.error("--expert-wait must be positive (seconds)")
    if args.expert_workers or args.ert:
        args.expert_table = expert_table(parser, args)
    if args.engine_command is not None and not args.engine_url:
        parser.error("--engine-command starts a real engine: give --engine-url too, the address it will answer at")
    if args.engine_command is not None and not args.engine_command.strip():
        parser.error("--engine-command is empty: give the command that starts the engine")
    if args.gpu_reset_command and args.engine_command is None:
        parser.error("--gpu-reset-command needs --engine-command: a GPU can be reset only while its engine is stopped")
    if args.engine_stop_timeout <= 0:
        parser.error("--engine-stop-timeout must be positive (seconds)")
    if args.enable_faults and not os.environ.get("LIFELINE_FAULT_TOKEN"):
        parser.error(
            "--enable-faults needs LIFELINE_FAULT_TOKEN in the environment: fault injection is always behind a token"
        )
    return args


def expert_table(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[ExpertRoutingTable, dict]:
    """The table and EW addresses an MoE attention worker starts with; a clear error for anything wrong."""
    model = catalog.MODELS[args.model]
    if not model.experts:
        parser.error(f"--expert-workers: {args.model} is not a mixture of experts")
    if args.engine_url:
        parser.error("--expert-workers runs the emulated engine's experts on expert workers; not with --engine-url")
    if not args.expert_workers or not args.ert:
        parser.error("an MoE attention worker needs both --expert-workers and --ert")
    addresses = {}
    for item in args.expert_workers.split(","):
        name, _, url = item.strip().partition("=")
        if not name or not url.startswith(("http://", "https://")):
            parser.error(f"--expert-workers: {item!r} is not name=URL such as ew-1=http://10.0.0.9:8300")
        addresses[name] = url.rstrip("/")
    try:
        with open(args.ert) as f:
            table = ExpertRoutingTable.parse(json.load(f), model)
    except (OSError, ValueError) as exc:
        parser.error(f"--ert {args.ert}: {exc}")
    missing = sorted(table.ews() - set(addresses))
    if missing:
        parser.error(f"--ert names expert workers --expert-workers does not give: {', '.join(missing)}")
    return table, addresses


def advertised_host(args: argparse.Namespace) -> str:
    """The host other machines reach this node at: --advertise-host, else the bound address,
    else (bound to all interfaces) this host's own address."""
    if args.advertise_host:
        return args.advertise_host
    if args.host not in ("0.0.0.0", "::", ""):
        return args.host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return socket.gethostname()


def build_engine(
    args: argparse.Namespace,
    deployment: catalog.Deployment,
    faults: FaultState,
    streamer: CheckpointStreamer,
    store: CheckpointStore,
) -> ServingEngine:
    """The emulated GPU engine, or an adapter in front of the real engine at --engine-url."""
    if args.engine_url:
        process = None
        if args.engine_command:
            process = EngineProcess(
                args.engine_command,
                log_path=Path(args.engine_log) if args.engine_log else None,
                stop_timeout_s=args.engine_stop_timeout,
                reset_command=args.gpu_reset_command or None,  # or nvidia-smi's, once NVML has seen the GPUs
            )
        return AdapterEngine(
            args.engine_url,
            deployment,
            args.name,
            args.engine_kind,
            args.engine_model,
            process=process,
            ready_wait_s=args.engine_wait,
        )
    return Engine(
        deployment,
        EngineConfig(time_scale=args.time_scale, max_num_seqs=args.max_num_seqs),
        name=args.name,
        placement=catalog.Placement(args.rack, args.server, args.nvl_domain, args.network),
        faults=faults,
        streamer=streamer,
        store=store,
    )


def build_runtime(args: argparse.Namespace) -> tuple[NodeRuntime, DcgmCollector]:
    deployment = catalog.Deployment.of(args.model, args.gpu, args.tp)
    host_memory = int((args.host_memory_gb or 2 * deployment.gpu.memory_gb * args.tp) * 1e9)
    agent_token = os.environ.get("LIFELINE_AGENT_TOKEN") or None
    headers = {"Authorization": f"Bearer {agent_token}"} if agent_token else {}
    faults = FaultState(enabled=args.enable_faults, tp=args.tp)
    store = CheckpointStore(int(host_memory * args.checkpoint_budget))
    streamer = CheckpointStreamer(args.name, deployment.model, headers, wire_scale=args.kv_wire_scale)
    engine = build_engine(args, deployment, faults, streamer, store)
    identity = Identity(
        name=args.name,
        rack=args.rack,
        host=socket.gethostname(),
        session=uuid.uuid4().hex,
        gpus=emulated_gpus(args.name, deployment.gpu, args.tp),
        spare=args.spare,
        server=args.server,
        nvl_domain=args.nvl_domain,
        network=args.network,
        provider=args.provider,
        region=args.region,
    )
    # The runtime holds the telemetry, and emulated figures follow the load the runtime measures:
    # built first, the telemetry looks the runtime up only when it reads.
    telemetry = open_telemetry(identity.gpus, deployment, lambda: runtime.load_for_telemetry(), faults)
    runtime = NodeRuntime(
        identity,
        engine,
        store,
        streamer,
        faults,
        telemetry=telemetry,
        agent_token=agent_token,
        fault_token=os.environ.get("LIFELINE_FAULT_TOKEN") or None,
        draft_agreement=args.draft_agreement,
        park_grace_s=args.park_grace,
    )
    identity.gpus = runtime.telemetry.gpus() or identity.gpus  # real GPUs when NVML sees them
    process = getattr(engine, "process", None)
    if isinstance(process, EngineProcess) and runtime.telemetry.source == "nvml":
        process.gpus = tuple(gpu.index for gpu in identity.gpus)
        process.reset_command = process.reset_command or default_reset_command(process.gpus)
    return runtime, DcgmCollector(runtime.telemetry, identity.host, identity.name)


async def serve(args: argparse.Namespace) -> str | None:
    """Serve until stopped; the model to serve next when the stop was a switch of model (POST /agent/model)."""
    runtime, collector = build_runtime(args)
    engine, identity, telemetry, loop_lag = runtime.engine, runtime.identity, runtime.telemetry, runtime.loop_lag
    app = build_app(runtime, collector)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = runner.addresses[0][1]  # the one site's socket: the port bound, a free one for --port 0
    identity.address = f"http://{advertised_host(args)}:{port}"
    if getattr(args, "expert_table", None):
        table, addresses = args.expert_table
        path = ExpertPath(
            engine.model,
            table,
            addresses,
            counters=engine.counters,
            wait_s=args.expert_wait,
            static=args.expert_binding == "static",
        )
        await path.start()
        cast(Engine, engine).experts = path  # the emulated engine's (parse_args refuses it with --engine-url)
    engine.start()
    engine.begin_load(cold=args.start == "cold")
    loop_lag.start()
    telemetry.start()
    # Everything built so far lives as long as the process: keep it out of the cyclic
    # collector's scans, so a full collection under load is short.
    gc.collect()
    gc.freeze()
    print(
        json.dumps({"event": "listening", "name": args.name, "address": identity.address, "pid": os.getpid()}),
        flush=True,
    )
    log.info(
        "%s: %s on %dx %s at %s (engine %s, %s start%s, telemetry %s)",
        args.name,
        engine.model.key,
        args.tp,
        engine.deployment.gpu.key,
        identity.address,
        engine.describe(),
        args.start,
        ", as a hot spare" if identity.spare else "",
        telemetry.source,
    )

    def registration() -> protocol.Registration:
        return protocol.Registration(
            name=identity.name,
            session=identity.session,
            address=identity.address,
            rack=identity.rack,
            model=engine.model.key,
            gpu=engine.deployment.gpu.key,
            tp=engine.deployment.tp,
            gpus=identity.gpus,
            pid=os.getpid(),
            host=identity.host,
            capabilities=tuple(offered_capabilities(runtime)),
            engine=engine.describe()["kind"],
            spare=identity.spare,
            server=identity.server,
            nvl_domain=identity.nvl_domain,
            network=identity.network,
            provider=identity.provider,
            region=identity.region,
        )

    gpu_telemetry = HeartbeatTelemetry(telemetry)
    token_rate = TokenRate(engine)

    async def heartbeat() -> protocol.Heartbeat:
        gpus = await gpu_telemetry.gpus()  # first: the figures below are the loop's own, read at once
        load = protocol.Load.of(engine.status(), tokens_per_s=token_rate.measure())
        return protocol.Heartbeat(
            session=identity.session,
            model_state=engine.model_state,
            load=load,
            checkpoints=runtime.store.by_source(),
            xids=gpu_telemetry.xids(),
            gpus=gpus,
        )

    def new_session() -> None:
        identity.session = uuid.uuid4().hex

    stop = asyncio.Event()
    runtime.request_stop = stop.set
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    link = None
    refused: list[EngineMismatch | EngineStartError] = []

    async def join() -> None:
        """Register once the engine is known to answer as it must (a real engine's adapter checks it first)."""
        try:
            await engine.before_joining(args.engine_wait)
        except (EngineMismatch, EngineStartError) as exc:
            refused.append(exc)
            stop.set()
            return
        if link is not None:
            await link.run()

    if args.control_url:
        link = ControlPlaneLink(
            args.control_url,
            os.environ.get("LIFELINE_NODE_TOKEN"),
            registration,
            heartbeat,
            args.heartbeat_interval,
            on_session_closed=new_session,
            partitioned=runtime.faults.partitioned,
        )
    else:
        log.info("no --control-url: running stand-alone, without registration or heartbeats")
    link_task = asyncio.create_task(join(), name="control-plane-link")

    await stop.wait()
    log.info("%s stopping", args.name)
    link_task.cancel()
    if link is not None and not refused:
        await link.leave(f"switching model to {runtime.switch_to}" if runtime.switch_to else "node stopped (signal)")
    await engine.stop()
    expert_path = getattr(engine, "experts", None)
    if expert_path is not None:
        await expert_path.aclose()
    await runtime.streamer.close()
    telemetry.close()
    await runner.cleanup()
    if refused:
        raise refused[0]
    return runtime.switch_to


class TokenRate:
    """Tokens the engine generated per second since the last heartbeat (a heartbeat's tokens_per_s)."""

    def __init__(self, engine: ServingEngine):
        self.engine = engine
        self.mark = (time.monotonic(), engine.counters.get("generation_tokens"))

    def measure(self) -> float:
        """0 where the engine does not count its tokens: the heartbeat's figures are numbers (protocol.Load)."""
        now, generated = time.monotonic(), self.engine.counters.get("generation_tokens")
        then, before = self.mark
        self.mark = (now, generated)
        if generated is None or before is None or now <= then:
            return 0.0
        return round((generated - before) / (now - then), 1)


def read_state(path: str) -> dict:
    """The state file's {"model", "started_as"}; {} when there is none, or it cannot be read (said in the log)."""
    if not path:
        return {}
    try:
        with open(path) as f:
            state = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("ignoring the state file %s: %s", path, exc)
        return {}
    return state if isinstance(state, dict) else {}


def resume_switch(args: argparse.Namespace) -> str:
    """Apply a switch of model the state file remembers; returns the model the node was first started with.

    A node started again with the command line it was first started with (a supervisor's restart after a crash)
    serves the model it had switched to, loading it cold. A command line naming another model is the operator's
    choice and wins: the state file is then forgotten."""
    state = read_state(args.state_file)
    started_as, model = state.get("started_as"), state.get("model")
    if model not in catalog.MODELS or not isinstance(started_as, str):
        return args.model
    if args.model == started_as and model != started_as:
        log.warning("%s: serving %s, which a switch of model left it serving (%s)", args.name, model, args.state_file)
        args.model, args.start = model, "cold"
        return started_as
    if args.model == model:  # started again by the switch itself (or already on the remembered model)
        return started_as
    return args.model


def remember_switch(path: str, model: str, started_as: str) -> None:
    """Write the state file (whole or not at all) before the node starts again on `model`."""
    if not path:
        return
    tmp = f"{path}.tmp"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(tmp, "w") as f:
        json.dump({"model": model, "started_as": started_as}, f)
    os.replace(tmp, path)


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    started_as = resume_switch(args)
    try:
        switch_to = asyncio.run(serve(args))
    except catalog.CatalogError as exc:
        sys.stderr.write(f"workers.node: {exc}\n")
        sys.exit(2)
    except (EngineMismatch, EngineStartError) as exc:
        sys.stderr.write(f"workers.node: {exc}\n")
        sys.exit(3)
    if switch_to:
        # The same process (its supervisor's pid, its name) starts again on the new model, loading it cold.
        remember_switch(args.state_file, switch_to, started_as)
        argv = switched_argv(sys.argv[1:] if argv is None else list(argv), switch_to)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, [sys.executable, "-m", "workers.node", *argv])


def switched_argv(argv: list[str], model: str) -> list[str]:
    """`argv` with --model and --start replaced: `model`, loaded cold."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--model", "--start"):
            skip = True
        elif not arg.startswith(("--model=", "--start=")):
            kept.append(arg)
    return [*kept, "--model", model, "--start", "cold"]


if __name__ == "__main__":
    main()
