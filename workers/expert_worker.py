"""An expert worker (EW) of a decoupled MoE deployment (document 001, TARRAGON): one process that holds some of a
model's experts on its GPUs, as primaries it serves and shadows it keeps loaded in residual memory, and answers
attention workers' per-layer dispatches.

    python -m workers.expert_worker --name ew-1 --model Mixtral-8x7B --gpu H100-SXM --experts 0,1 --shadows 2,3

`POST /moe/layer` takes one AW's tokens for one layer, each with the logical expert it selected and its
activation, and answers each token's expert output (`workers.moe.expert_output`, a pure function, so a replay on
another EW gives the same answer). Tokens are batched per layer and expert as an EW does: a dispatch waits up to
BATCH_WINDOW_S for others of the same layer, then the batch runs for its roofline time (the expert's weights read
once, two FLOPs per parameter per token, at the catalog's efficiencies) times the time scale. A replayed dispatch
(an AW's failover after another EW failed, §5.1) skips the window and goes first. A token for an expert this EW
does not hold, or for a layer the model does not have, is refused (400, naming it) and nothing of that dispatch
is computed. `GET /moe/status` gives what it holds, the memory that takes, tokens per expert and its frontier.

`POST /moe/load` (the agent token) is the control plane's: the experts it should hold from now on, as primaries and
shadows. Experts it no longer holds are dropped at once; new ones load at disk bandwidth in the background, and it
serves them once loaded (`state` "loading" until then). This is how a standby EW becomes the replacement of a lost
one (document 001 §5.4, background provisioning), and how an EW that comes back after its replacement took its
experts becomes the standby (it is told to hold nothing).
"""

import argparse
import asyncio
import json
import logging
import os
import socket
import sys
from collections import Counter

from aiohttp import web

from workers import catalog
from workers.moe import MoeError, expert_bytes, expert_output, expert_params, require_moe
from workers.openai_api import read_json
from workers.openai_schema import ApiError
from workers.runtime import token_matches

log = logging.getLogger("workers.expert_worker")
BATCH_WINDOW_S = 0.001  # how long a dispatch waits for others of its layer before its batch runs
MAX_TOKENS = 65_536  # per dispatch: a larger one is refused, not queued


def expert_batch_s(model: catalog.Model, gpu: catalog.Gpu, experts_tokens: Counter) -> float:
    """The roofline time of one layer's batch: for each expert touched, its weights read once (memory bound at
    small batches) or two FLOPs per parameter per token (compute bound at large ones)."""
    params = expert_params(model)
    total = 0.0
    for tokens in experts_tokens.values():
        read = params * catalog.BYTES_PER_PARAM / (gpu.hbm_gbps * catalog.GB * catalog.DECODE_BANDWIDTH_EFFICIENCY)
        compute = 2 * params * tokens / (gpu.tflops * 1e12 * catalog.PREFILL_COMPUTE_EFFICIENCY)
        total += max(read, compute)
    return total


def _ints(raw: str, option: str) -> tuple[int, ...]:
    try:
        return tuple(sorted({int(x) for x in raw.split(",") if x.strip()}))
    except ValueError:
        raise SystemExit(f"workers.expert_worker: {option} {raw!r} is not a comma-separated list of experts") from None


class ExpertWorker:
    def __init__(self, name: str, model: catalog.Model, gpu: catalog.Gpu, experts, shadows, time_scale: float):
        self.name, self.model, self.gpu, self.time_scale = name, require_moe(model), gpu, time_scale
        self.primaries, self.shadows = self.check_holding(experts, shadows)
        self.loading: set[int] = set()  # experts whose weights are being read for a /moe/load
        self._load_task: asyncio.Task | None = None
        self.corrupt = False  # fault injection (staging): answers well formed and wrong, silent corruption
        # fault injection (staging): a hung process: the data path and status stop answering until cleared
        self.running = asyncio.Event()
        self.running.set()
        self.tokens: Counter = Counter()  # per expert, served
        self.refused = 0
        self.frontier = -1  # the layer of the last batch run
        self._pending: dict[int, list] = {}  # layer -> [(tokens, future)] waiting for the batch
        self._lock = asyncio.Lock()  # one batch runs at a time: the GPU's

    def holds(self, expert: int) -> bool:
        return expert in self.primaries or expert in self.shadows

    @property
    def state(self) -> str:
        if self.loading:
            return "loading"
        return "serving" if self.primaries or self.shadows else "standby"

    def check_holding(self, experts, shadows) -> tuple[set[int], set[int]]:
        """The sets it would hold, refused (MoeError naming the part) when not experts of its model or too many."""
        primaries, shadows = set(experts), set(shadows) - set(experts)
        bad = sorted(e for e in primaries | shadows if not 0 <= e < self.model.experts)
        if bad:
            raise MoeError("experts", f"{bad} are not experts of {self.model.key} (0 to {self.model.experts - 1})")
        held = expert_bytes(self.model) * len(primaries | shadows)
        if held > self.gpu.memory_bytes * catalog.GPU_MEMORY_UTILIZATION:
            raise MoeError(
                "experts",
                f"{len(primaries | shadows)} experts of {self.model.key} take {held / catalog.GB:.1f} GB, "
                f"more than one {self.gpu.key} holds",
            )
        return primaries, shadows

    def load(self, experts, shadows) -> float:
        """Hold `experts` and `shadows` from now on: others dropped at once, new ones loaded in the background.
        Returns the seconds the load takes (0 when nothing is new). A load supersedes one still running."""
        primaries, shadows = self.check_holding(experts, shadows)
        if self._load_task is not None:
            self._load_task.cancel()
        keep = (self.primaries | self.shadows) & (primaries | shadows)
        self.primaries, self.shadows = self.primaries & keep, self.shadows & keep
        new = (primaries | shadows) - keep
        seconds = expert_bytes(self.model) * len(new) / (catalog.DISK_GBPS * catalog.GB) * self.time_scale
        self.loading = set(new)

        async def read_weights() -> None:
            await asyncio.sleep(seconds)
            self.primaries, self.shadows, self.loading = primaries, shadows, set()
            log.info("%s: loaded; experts %s, shadows %s", self.name, sorted(primaries), sorted(shadows))

        if new:
            self._load_task = asyncio.get_running_loop().create_task(read_weights())
        else:
            self.primaries, self.shadows = primaries, shadows
        return seconds

    def parse(self, body) -> tuple[int, list[tuple[str, int, bytes, int]], bool]:
        if not isinstance(body, dict):
            raise MoeError("body", "must be a JSON object")
        layer = body.get("layer")
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.model.layers:
            raise MoeError("layer", f"{layer!r} is not a layer of {self.model.key} (0 to {self.model.layers - 1})")
        raw = body.get("tokens")
        if not isinstance(raw, list) or not raw or len(raw) > MAX_TOKENS:
            raise MoeError("tokens", f"must be a list of 1 to {MAX_TOKENS} tokens")
        tokens = []
        for i, t in enumerate(raw):
            if not isinstance(t, dict) or not isinstance(t.get("id"), str) or not isinstance(t.get("expert"), int):
                raise MoeError(f"tokens[{i}]", "must be {id, expert, activation}")
            if not self.holds(t["expert"]):
                raise MoeError(f"tokens[{i}].expert", f"expert {t['expert']} is not held by {self.name}")
            try:
                activation = bytes.fromhex(t.get("activation") or "")
            except (TypeError, ValueError):
                raise MoeError(f"tokens[{i}].activation", "must be hex") from None
            count = t.get("count", 1)  # a prefill chunk's tokens travel as one entry, each accounted
            if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_TOKENS:
                raise MoeError(f"tokens[{i}].count", f"must be 1 to {MAX_TOKENS}")
            tokens.append((t["id"], t["expert"], activation, count))
        return layer, tokens, bool(body.get("replay"))

    async def dispatch(self, layer: int, tokens: list, replay: bool) -> list[dict]:
        future = asyncio.get_running_loop().create_future()
        self._pending.setdefault(layer, []).append((tokens, future))
        if not replay:
            await asyncio.sleep(BATCH_WINDOW_S)  # others of this layer join the batch
        await self._run(layer)
        return await future

    async def _run(self, layer: int) -> None:
        async with self._lock:
            waiting = self._pending.pop(layer, [])
            if not waiting:
                return  # another dispatch's run took this batch
            per_expert: Counter = Counter()
            for tokens, _ in waiting:
                for _, expert, _, count in tokens:
                    per_expert[expert] += count
            await asyncio.sleep(expert_batch_s(self.model, self.gpu, per_expert) * self.time_scale)
            self.frontier = layer
            self.tokens.update(per_expert)
            for tokens, future in waiting:
                if not future.done():
                    future.set_result(
                        [
                            {"id": tid, "expert": e, "output": self.output(layer, e, act).hex()}
                            for tid, e, act, _ in tokens
                        ]
                    )

    def output(self, layer: int, expert: int, activation: bytes) -> bytes:
        if self.corrupt:  # what a bit flip in the weights does: a plausible answer, the wrong one
            return expert_output(self.model, layer, expert, activation + b"\x01")
        return expert_output(self.model, layer, expert, activation)

    def status(self) -> dict:
        size = expert_bytes(self.model)
        return {
            "name": self.name,
            "state": self.state,
            "model": self.model.key,
            "gpu": self.gpu.key,
            "pid": os.getpid(),
            "primaries": sorted(self.primaries),
            "shadows": sorted(self.shadows),
            "loading": sorted(self.loading),
            "memory_bytes": {"primaries": size * len(self.primaries), "shadows": size * len(self.shadows)},
            "tokens_per_expert": {str(e): n for e, n in sorted(self.tokens.items())},
            "refused": self.refused,
            "frontier": self.frontier,
        }


EW_FAULTS = ("corrupt", "hang")  # what /moe/faults injects


def _token_ok(request: web.Request, token: str | None) -> bool:
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    return bool(token) and scheme.lower() == "bearer" and token_matches(value.strip(), token)


def build_app(worker: ExpertWorker, agent_token: str | None = None, fault_token: str | None = None) -> web.Application:
    async def layer(request: web.Request) -> web.Response:
        await worker.running.wait()
        try:
            body = await request.json()
        except ValueError:
            body = None
        try:
            layer_index, tokens, replay = worker.parse(body)
        except MoeError as exc:
            worker.refused += 1
            return web.json_response({"error": {"message": str(exc), "param": exc.field}}, status=400)
        outputs = await worker.dispatch(layer_index, tokens, replay)
        return web.json_response({"ew": worker.name, "layer": layer_index, "outputs": outputs})

    async def health(request: web.Request) -> web.Response:
        await worker.running.wait()
        return web.json_response({"ok": True, "name": worker.name})

    async def status(request: web.Request) -> web.Response:
        await worker.running.wait()
        return web.json_response(worker.status())

    async def load(request: web.Request) -> web.Response:
        if not agent_token:
            return _error(503, "control endpoints are off on this EW: start it with LIFELINE_AGENT_TOKEN set", None)
        if not _token_ok(request, agent_token):
            return _error(401, "the agent token is missing or wrong: send `Authorization: Bearer <agent token>`", None)
        try:
            body = await read_json(request)
        except ApiError as exc:
            return _error(400, str(exc), exc.param)
        lists = {}
        for field in ("experts", "shadows"):
            value = body.get(field, [])
            if not isinstance(value, list) or not all(isinstance(e, int) and not isinstance(e, bool) for e in value):
                return _error(400, f"{field}: must be a list of expert numbers", field)
            lists[field] = value
        try:
            seconds = worker.load(lists["experts"], lists["shadows"])
        except MoeError as exc:
            return _error(400, str(exc), exc.field)
        return web.json_response({**worker.status(), "load_s": round(seconds, 3)}, status=202)

    async def faults(request: web.Request) -> web.Response:
        """Staging only (--enable-faults and the fault token): {"kind": "corrupt"} makes every answer silently
        wrong, {"kind": "hang"} stops the data path, /health and /moe/status answering (a hung process; this
        endpoint still answers), {"kind": null} clears either."""
        if not fault_token:
            return _error(404, "fault injection is off on this EW (start it with --enable-faults)", None)
        if not _token_ok(request, fault_token):
            return _error(401, "the fault token is missing or wrong: send `Authorization: Bearer <fault token>`", None)
        try:
            body = await read_json(request)
        except ApiError as exc:
            return _error(400, str(exc), exc.param)
        kind = body.get("kind")
        if kind not in (*EW_FAULTS, None):
            return _error(400, f'kind: {kind!r} is not a fault of an EW: expected "corrupt", "hang" or null', "kind")
        worker.corrupt = kind == "corrupt"
        if kind == "hang":
            worker.running.clear()
        else:
            worker.running.set()
        log.warning("%s: fault %s", worker.name, f"{kind} injected" if kind else "cleared")
        return web.json_response({"corrupt": worker.corrupt, "hung": not worker.running.is_set()})

    app = web.Application(client_max_size=64 * 1024**2)
    app.router.add_post("/moe/faults", faults)
    app.router.add_post("/moe/load", load)
    app.router.add_post("/moe/layer", layer)
    app.router.add_get("/health", health)
    app.router.add_get("/moe/status", status)
    return app


def _error(status: int, message: str, param: str | None) -> web.Response:
    return web.json_response({"error": {"message": message, "param": param}}, status=status)


async def serve(args: argparse.Namespace) -> None:
    model, gpu = catalog.MODELS[args.model], catalog.GPUS[args.gpu]
    worker = ExpertWorker(args.name, model, gpu, args.experts, args.shadows, args.time_scale)
    if args.start == "cold":
        # A provisioned replacement loads its experts' weights from disk before it listens (document 001 §5.4).
        held = expert_bytes(model) * len(worker.primaries | worker.shadows)
        await asyncio.sleep(held / (catalog.DISK_GBPS * catalog.GB) * args.time_scale)
    fault_token = (os.environ.get("LIFELINE_FAULT_TOKEN") or None) if args.enable_faults else None
    app = build_app(worker, os.environ.get("LIFELINE_AGENT_TOKEN") or None, fault_token)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = runner.addresses[0][1]
    address = f"http://{args.host}:{port}"
    print(json.dumps({"event": "listening", "name": args.name, "address": address, "pid": os.getpid()}), flush=True)
    log.info(
        "%s: %s experts %s, shadows %s on %s at %s",
        args.name,
        model.key,
        sorted(worker.primaries),
        sorted(worker.shadows),
        gpu.key,
        address,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (2, 15):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await runner.cleanup()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m workers.expert_worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default=socket.gethostname())
    moe_models = sorted(k for k, m in catalog.MODELS.items() if m.experts)
    parser.add_argument("--model", default="Mixtral-8x7B", choices=moe_models)
    parser.add_argument("--gpu", default="H100-SXM", choices=sorted(catalog.GPUS))
    parser.add_argument("--experts", default="", help="the experts it serves (primaries), comma-separated")
    parser.add_argument("--shadows", default="", help="the experts it keeps loaded as shadows, comma-separated")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiplies the modelled GPU time")
    parser.add_argument(
        "--start",
        choices=("warm", "cold"),
        default="warm",
        help="cold: load the experts' weights at disk bandwidth before listening (a replacement); warm: at once",
    )
    parser.add_argument(
        "--enable-faults",
        action="store_true",
        help="allow fault injection at /moe/faults (with LIFELINE_FAULT_TOKEN); staging only",
    )
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    args.experts, args.shadows = _ints(args.experts, "--experts"), _ints(args.shadows, "--shadows")
    if args.time_scale <= 0:
        parser.error("--time-scale must be positive")
    if args.enable_faults and not os.environ.get("LIFELINE_FAULT_TOKEN"):
        parser.error("--enable-faults needs LIFELINE_FAULT_TOKEN in the environment: fault injection is behind a token")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(args))
    except MoeError as exc:
        sys.stderr.write(f"workers.expert_worker: {exc}\n")
        sys.exit(2)


if __name__ == "__main__":
    main()
