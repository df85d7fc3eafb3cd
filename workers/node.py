"""Run one serving node: `python -m workers.node --name node-01 --rack rack-a`.

The node binds its agent (port 0 picks a free one), prints one JSON line with
its address and pid, registers with the control plane and sends heartbeats
until SIGTERM or SIGINT, when it tells the control plane it is leaving.
"""

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
import uuid

from aiohttp import web

from workers import catalog, protocol
from workers.agent import Identity, build_app
from workers.control import ControlPlaneLink
from workers.engine import Engine, EngineConfig

log = logging.getLogger("workers.node")


def parse_args(argv=None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(prog="python -m workers.node", description="Run one Lifeline serving node (emulated GPU engine).")
    parser.add_argument("--name", default=env("LIFELINE_NODE_NAME", socket.gethostname()), help="node name, unique in the cluster")
    parser.add_argument("--rack", default=env("LIFELINE_NODE_RACK", "rack-a"))
    parser.add_argument("--model", default=env("LIFELINE_NODE_MODEL", "Qwen3-32B"), choices=sorted(catalog.MODELS))
    parser.add_argument("--gpu", default=env("LIFELINE_NODE_GPU", "H100-SXM"), choices=sorted(catalog.GPUS))
    parser.add_argument("--tp", type=int, default=int(env("LIFELINE_NODE_TP", "1")), choices=catalog.TP_DEGREES)
    parser.add_argument("--host", default=env("LIFELINE_NODE_HOST", "127.0.0.1"), help="address to bind")
    parser.add_argument("--port", type=int, default=int(env("LIFELINE_NODE_PORT", "0")), help="port to bind; 0 picks a free one")
    parser.add_argument("--advertise-host", default=env("LIFELINE_NODE_ADVERTISE_HOST"), help="host other machines reach this node at (default: --host)")
    parser.add_argument("--control-url", default=env("LIFELINE_CONTROL_URL"), help="base URL of the Lifeline console, e.g. http://127.0.0.1:8000")
    parser.add_argument("--heartbeat-interval", type=float, default=float(env("LIFELINE_HEARTBEAT_INTERVAL_S", "1.0")))
    parser.add_argument("--time-scale", type=float, default=float(env("LIFELINE_TIME_SCALE", "1.0")), help="multiplies emulated GPU time; 0.5 runs twice as fast")
    parser.add_argument("--max-num-seqs", type=int, default=int(env("LIFELINE_MAX_NUM_SEQS", "128")), help="batch limit")
    parser.add_argument("--log-level", default=env("LIFELINE_LOG_LEVEL", "INFO"))
    args = parser.parse_args(argv)
    if args.time_scale <= 0:
        parser.error("--time-scale must be positive")
    return args


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


def emulated_gpus(name: str, gpu: catalog.Gpu, tp: int) -> tuple[protocol.GpuInfo, ...]:
    """Stable, UUID-shaped identities for the GPUs of an emulated node."""
    return tuple(
        protocol.GpuInfo(i, f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{name}.gpu{i}.lifeline')}", gpu.name, gpu.memory_bytes)
        for i in range(tp)
    )


async def serve(args: argparse.Namespace) -> None:
    deployment = catalog.Deployment.of(args.model, args.gpu, args.tp)
    engine = Engine(deployment, EngineConfig(time_scale=args.time_scale, max_num_seqs=args.max_num_seqs), name=args.name)
    identity = Identity(
        name=args.name,
        rack=args.rack,
        host=socket.gethostname(),
        session=uuid.uuid4().hex,
        gpus=emulated_gpus(args.name, deployment.gpu, args.tp),
    )
    app = build_app(engine, identity)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    identity.address = f"http://{advertised_host(args)}:{port}"
    engine.start()
    print(json.dumps({"event": "listening", "name": args.name, "address": identity.address, "pid": os.getpid()}), flush=True)
    log.info("%s serving %s on %dx %s at %s", args.name, deployment.model.key, args.tp, deployment.gpu.key, identity.address)

    def registration() -> protocol.Registration:
        return protocol.Registration(
            name=identity.name,
            session=identity.session,
            address=identity.address,
            rack=identity.rack,
            model=deployment.model.key,
            gpu=deployment.gpu.key,
            tp=deployment.tp,
            gpus=identity.gpus,
            pid=os.getpid(),
            host=identity.host,
            capabilities=("openai", "events"),
        )

    def heartbeat() -> protocol.Heartbeat:
        s = engine.status()
        load = protocol.Load(
            running=s["running"],
            waiting=s["waiting"],
            kv_blocks_used=s["kv_blocks_used"],
            kv_blocks_total=s["kv_blocks_total"],
            step_ms=s["step_ms"],
        )
        return protocol.Heartbeat(session=identity.session, model_state=engine.model_state, load=load)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    link = None
    link_task = None
    if args.control_url:
        link = ControlPlaneLink(args.control_url, os.environ.get("LIFELINE_NODE_TOKEN"), registration, heartbeat, args.heartbeat_interval)
        link_task = asyncio.create_task(link.run(), name="control-plane-link")
    else:
        log.info("no --control-url: running stand-alone, without registration or heartbeats")

    await stop.wait()
    log.info("%s stopping", args.name)
    if link_task is not None:
        link_task.cancel()
        await link.leave("node stopped (signal)")
    await engine.stop()
    await runner.cleanup()


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        asyncio.run(serve(args))
    except catalog.CatalogError as exc:
        sys.stderr.write(f"workers.node: {exc}\n")
        sys.exit(2)


if __name__ == "__main__":
    main()
