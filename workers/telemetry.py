"""GPU telemetry for the node agent: readings, their two sources, and the DCGM-named export.

On a GPU host the figures come from NVML (through the `workers.nvml` seam);
anywhere else they are emulated from the engine's load and the injected
faults, and marked `source: emulated` so nobody mistakes them for hardware.
A figure a GPU cannot give is None (shown as n/a), never a healthy-looking zero.

`python -m workers.telemetry` prints what this host reads, as JSON.
"""

import asyncio
import json
import logging
import socket
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

from prometheus_client.core import GaugeMetricFamily

from workers import catalog, protocol
from workers import faults as faults_mod
from workers.nvml import GpuLost, NotSupported, Nvml, NvmlError, NvmlUnavailable
from workers.protocol import GpuInfo

log = logging.getLogger("workers.telemetry")

MIB = 1024**2

# Clock event (throttle) reason bits, as NVML reports them.
THROTTLE_IDLE = 0x1
THROTTLE_SW_POWER_CAP = 0x4
THROTTLE_HW_SLOWDOWN = 0x8
THROTTLE_SW_THERMAL = 0x20
THROTTLE_HW_THERMAL = 0x40
THROTTLE_POWER_BRAKE = 0x80

XID_WAIT_MS = 500  # how long the Xid thread blocks in NVML before checking whether to stop


@dataclass(frozen=True)
class GpuReading:
    """One GPU's figures at one moment. None means n/a: the GPU cannot report it."""

    index: int
    uuid: str | None
    name: str | None
    source: str  # "nvml" or "emulated"
    lost: bool = False
    utilization_pct: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    sm_clock_mhz: int | None = None
    sm_clock_max_mhz: int | None = None
    throttle_reasons: int | None = None
    ecc_uncorrected_volatile: int | None = None
    remapped_rows: dict | None = None
    nvlink_up: list[bool] | None = None
    last_xid: int | None = None  # an event, not a reading: kept for a lost GPU, it says why

    def to_json(self) -> dict:
        return asdict(self)

    @property
    def nvlink_links(self) -> int | None:
        """NVLink links this GPU has (None: no NVLink, or not read)."""
        return None if self.nvlink_up is None else len(self.nvlink_up)

    @property
    def nvlink_links_down(self) -> int | None:
        """Its NVLink links reported down: what a heartbeat carries of the NVLink state."""
        return None if self.nvlink_up is None else sum(1 for up in self.nvlink_up if not up)


@dataclass(frozen=True)
class XidEvent:
    at: float  # epoch seconds
    gpu_index: int | None
    gpu_uuid: str | None
    code: int

    def to_json(self) -> dict:
        return asdict(self)


class _XidLog:
    """Xid events in arrival order; a cursor is how many a reader has already seen."""

    def __init__(self):
        self._lock = threading.Lock()
        self._events: list[XidEvent] = []

    def add(self, event: XidEvent) -> None:
        with self._lock:
            self._events.append(event)

    def since(self, cursor: int) -> tuple[list[XidEvent], int]:
        with self._lock:
            return self._events[cursor:], len(self._events)

    def last_code(self, index: int) -> int | None:
        with self._lock:
            return next((e.code for e in reversed(self._events) if e.gpu_index == index), None)


# --- NVML -------------------------------------------------------------------------


class NvmlTelemetry:
    """Real figures from NVML. Takes an `Nvml` already initialised; `close()` shuts it down."""

    source = "nvml"

    def __init__(self, nvml: Nvml):
        self.nvml = nvml
        self._handles = []
        self._identities: list[GpuInfo | None] = []
        for index in range(nvml.device_count()):
            handle, identity = None, None
            try:
                handle = nvml.handle(index)
                _used, total = nvml.memory(handle)
                identity = GpuInfo(index, nvml.uuid(handle), nvml.name(handle), total)
            except GpuLost as exc:
                log.warning("GPU %d is lost at start (%s)", index, exc)
            self._handles.append(handle)
            self._identities.append(identity)
        self._xids = _XidLog()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._event_set = None
        self._failed_figures: set[tuple[int, str]] = set()

    def gpus(self) -> tuple[GpuInfo, ...]:
        """The GPUs NVML could identify; one lost before we started has no UUID to give."""
        return tuple(identity for identity in self._identities if identity is not None)

    def read(self) -> list[GpuReading]:
        return [self._read_one(index) for index in range(len(self._handles))]

    def _read_one(self, index: int) -> GpuReading:
        identity = self._identities[index]
        uuid = identity.uuid if identity else None
        name = identity.name if identity else None
        handle = self._handles[index]
        last_xid = self._xids.last_code(index)
        if handle is None:
            return GpuReading(index, uuid, name, self.source, lost=True, last_xid=last_xid)
        try:
            memory = self._figure(index, "memory", handle)
            return GpuReading(
                index,
                uuid,
                name,
                self.source,
                utilization_pct=self._figure(index, "utilization_pct", handle),
                memory_used_bytes=memory[0] if memory else None,
                memory_total_bytes=memory[1] if memory else None,
                temperature_c=self._figure(index, "temperature_c", handle),
                power_w=self._figure(index, "power_w", handle),
                power_limit_w=self._figure(index, "power_limit_w", handle),
                sm_clock_mhz=self._figure(index, "sm_clock_mhz", handle),
                sm_clock_max_mhz=self._figure(index, "sm_clock_max_mhz", handle),
                throttle_reasons=self._figure(index, "throttle_reasons", handle),
                ecc_uncorrected_volatile=self._figure(index, "ecc_uncorrected_volatile", handle),
                remapped_rows=self._figure(index, "remapped_rows", handle),
                nvlink_up=self._figure(index, "nvlink_up", handle),
                last_xid=last_xid,
            )
        except GpuLost:
            # A fault to report, not an error to raise: the agent keeps serving the other GPUs.
            return GpuReading(index, uuid, name, self.source, lost=True, last_xid=last_xid)

    def _figure(self, index: int, reading: str, handle):
        """One reading, None where the GPU cannot give it. GpuLost goes up: the whole GPU is lost."""
        try:
            return getattr(self.nvml, reading)(handle)
        except NotSupported:
            return None
        except GpuLost:
            raise
        except NvmlError as exc:
            # Anything else (no permission, unknown error) is n/a too; say so once, not every scrape.
            if (index, reading) not in self._failed_figures:
                self._failed_figures.add((index, reading))
                log.warning("GPU %d: reading %s failed (%s); reported as n/a", index, reading, exc)
            return None

    # --- Xid events ---------------------------------------------------------------
    def start(self) -> None:
        """Watch Xid events on a daemon thread: NVML only offers a blocking wait."""
        if self._thread is not None:
            return
        try:
            self._event_set = self.nvml.xid_event_set([h for h in self._handles if h is not None])
        except NvmlError as exc:
            log.warning("Xid events are not available on this host (%s)", exc)
            return
        self._thread = threading.Thread(target=self._watch_xids, name="nvml-xid-events", daemon=True)
        self._thread.start()

    def _watch_xids(self) -> None:
        failing = False
        while not self._stop.is_set():
            try:
                event = self.nvml.wait_xid(self._event_set, XID_WAIT_MS)
            except NvmlError as exc:
                if not failing:
                    log.warning("waiting for Xid events failed (%s); retrying", exc)
                failing = True
                self._stop.wait(1.0)
                continue
            failing = False
            if event is not None:
                gpu, code = event
                index, uuid = self._locate(gpu)
                self._xids.add(XidEvent(time.time(), index, uuid, code))

    def _locate(self, gpu: str | int | None) -> tuple[int | None, str | None]:
        """(index, UUID) from whichever of the two the event carried."""
        for identity in self._identities:
            if identity is not None and gpu in (identity.uuid, identity.index):
                return identity.index, identity.uuid
        if isinstance(gpu, int):
            return gpu, None
        return None, gpu

    def xid_events_since(self, cursor: int) -> tuple[list[XidEvent], int]:
        return self._xids.since(cursor)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        try:
            if self._event_set is not None:
                self.nvml.free_event_set(self._event_set)
                self._event_set = None
            self.nvml.shutdown()
        except NvmlError as exc:
            log.warning("NVML shutdown failed (%s)", exc)


# --- emulation --------------------------------------------------------------------


@dataclass(frozen=True)
class Board:
    """Board figures NVML reports that the hardware catalog does not hold."""

    power_limit_w: float
    sm_clock_max_mhz: int
    ecc: bool  # consumer cards have no ECC: NVML answers NotSupported
    nvlinks: int  # links per GPU where the catalog link is NVLink or NVSwitch


BOARDS: dict[str, Board] = {
    "H100-SXM": Board(700, 1980, ecc=True, nvlinks=18),
    "H100-PCIe": Board(350, 1755, ecc=True, nvlinks=0),
    "H200-SXM": Board(700, 1980, ecc=True, nvlinks=18),
    "GH200": Board(900, 1980, ecc=True, nvlinks=18),  # the module's limit, Grace CPU included
    "A100-80GB": Board(400, 1410, ecc=True, nvlinks=12),
    "L40S": Board(350, 2520, ecc=True, nvlinks=0),
    "RTX-4090": Board(450, 2520, ecc=False, nvlinks=0),
    "RTX-3090": Board(350, 1695, ecc=False, nvlinks=0),
}

IDLE_POWER_SHARE = 0.12  # an idle datacenter GPU draws about an eighth of its limit
IDLE_TEMPERATURE_C = faults_mod.THERMAL_BASE_C
BUSY_TEMPERATURE_RISE_C = 30.0
CONTEXT_BYTES = int(2 * catalog.GB)  # CUDA context and activations beside weights and KV
THERMAL_THROTTLE_PROGRESS = 0.3  # past this share of the thermal ramp, the clocks are throttled


class EmulatedTelemetry:
    """Figures a GPU would show under the engine's load and the injected faults."""

    source = "emulated"

    def __init__(
        self,
        gpus: tuple[GpuInfo, ...],
        deployment: catalog.Deployment,
        load: Callable[[], dict],
        faults: faults_mod.FaultState,
    ):
        self._gpus = tuple(gpus)
        self.deployment = deployment
        self.load = load
        self.faults = faults
        self.board = BOARDS[deployment.gpu.key]

    def gpus(self) -> tuple[GpuInfo, ...]:
        return self._gpus

    def read(self, now: float | None = None) -> list[GpuReading]:
        now = time.time() if now is None else now
        load = self.load()
        busy = min(max(float(load.get("busy_fraction", 0.0)), 0.0), 1.0)
        kv_bytes = int(load.get("kv_bytes_used", 0))
        return [self._read_one(gpu, busy, kv_bytes, now) for gpu in self._gpus]

    def _read_one(self, gpu: GpuInfo, busy: float, kv_bytes: int, now: float) -> GpuReading:
        faults, board, tp = self.faults, self.board, self.deployment.tp
        last_xid = next((x.code for x in reversed(faults.xids) if x.gpu == gpu.index), None)
        if gpu.index in faults.lost_gpus:
            return GpuReading(gpu.index, gpu.uuid, gpu.name, self.source, lost=True, last_xid=last_xid)

        utilization = busy * 100
        used = self.deployment.model.weight_bytes // tp + kv_bytes // tp + CONTEXT_BYTES
        temperature = IDLE_TEMPERATURE_C + BUSY_TEMPERATURE_RISE_C * busy
        progress = faults.thermal_progress(now)
        if progress > 0:
            target = faults.active["thermal"].params["target_c"]
            temperature += (target - temperature) * progress
        throttle = THROTTLE_IDLE if utilization < 1 else 0
        if progress > THERMAL_THROTTLE_PROGRESS:
            throttle |= THROTTLE_SW_THERMAL | THROTTLE_HW_THERMAL

        ecc, rows = None, None
        if board.ecc:
            ecc = faults.ecc_uncorrected.get(gpu.index, 0)
            rows = dict(
                faults.remapped_rows.get(gpu.index)
                or {"correctable": 0, "uncorrectable": 0, "pending": False, "failure": False}
            )
        nvlink = None
        if self.deployment.gpu.link != "pcie":
            nvlink = [not faults.nvlink_down] * board.nvlinks

        return GpuReading(
            gpu.index,
            gpu.uuid,
            gpu.name,
            self.source,
            utilization_pct=utilization,
            memory_used_bytes=min(used, gpu.memory_bytes),
            memory_total_bytes=gpu.memory_bytes,
            temperature_c=round(temperature, 1),
            power_w=round(board.power_limit_w * (IDLE_POWER_SHARE + (1 - IDLE_POWER_SHARE) * busy), 1),
            power_limit_w=float(board.power_limit_w),
            sm_clock_mhz=round(board.sm_clock_max_mhz * faults.clock_factor(now)),
            sm_clock_max_mhz=board.sm_clock_max_mhz,
            throttle_reasons=throttle,
            ecc_uncorrected_volatile=ecc,
            remapped_rows=rows,
            nvlink_up=nvlink,
            last_xid=last_xid,
        )

    def xid_events_since(self, cursor: int) -> tuple[list[XidEvent], int]:
        injections, cursor = self.faults.xid_events_since(cursor)
        uuids = {gpu.index: gpu.uuid for gpu in self._gpus}
        return [XidEvent(x.at, x.gpu, uuids.get(x.gpu), x.code) for x in injections], cursor

    def start(self) -> None:
        """Nothing to watch: injected Xids are already in the fault state."""

    def close(self) -> None:
        pass


def emulated_gpus(name: str, gpu: catalog.Gpu, tp: int) -> tuple[GpuInfo, ...]:
    """Stable, UUID-shaped identities for the GPUs of an emulated node."""
    return tuple(
        GpuInfo(i, f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{name}.gpu{i}.lifeline')}", gpu.name, gpu.memory_bytes)
        for i in range(tp)
    )


def open_telemetry(
    gpus: tuple[GpuInfo, ...],
    deployment: catalog.Deployment,
    load: Callable[[], dict],
    faults: faults_mod.FaultState,
    nvml: Nvml | None = None,
) -> NvmlTelemetry | EmulatedTelemetry:
    """NVML where this host has GPUs; otherwise emulated figures over the given (emulated) GPUs."""
    nvml = Nvml() if nvml is None else nvml
    try:
        nvml.init()
    except NvmlUnavailable as exc:
        log.info("This host has no GPU (NVML: %s): serving emulated GPU telemetry, marked source: emulated", exc)
        return EmulatedTelemetry(gpus, deployment, load, faults)
    except NvmlError as exc:
        log.warning("NVML failed to start (%s): serving emulated GPU telemetry, marked source: emulated", exc)
        return EmulatedTelemetry(gpus, deployment, load, faults)
    try:
        if nvml.device_count() == 0:
            log.info("NVML sees no GPU on this host: serving emulated GPU telemetry, marked source: emulated")
            _shutdown_quietly(nvml)
            return EmulatedTelemetry(gpus, deployment, load, faults)
        return NvmlTelemetry(nvml)
    except NvmlError as exc:
        log.warning(
            "NVML could not list this host's GPUs (%s): serving emulated GPU telemetry, marked source: emulated", exc
        )
        _shutdown_quietly(nvml)
        return EmulatedTelemetry(gpus, deployment, load, faults)


def _shutdown_quietly(nvml: Nvml) -> None:
    try:
        nvml.shutdown()
    except NvmlError:
        pass


# --- heartbeats --------------------------------------------------------------------

HEARTBEAT_READ_TIMEOUT_S = 0.5  # a heartbeat waits this long for the GPUs, then goes without them


class HeartbeatTelemetry:
    """What a heartbeat carries from telemetry: a compact reading per GPU and the recent Xid events.

    Reading the GPUs must never cost a heartbeat: NVML can fail, or block for
    seconds on a GPU falling off the bus, and a late heartbeat marks the node
    DOWN. So the read runs on a daemon thread (one stuck in NVML must not keep
    the process from exiting), one read at a time; a heartbeat that cannot have
    it in time, or whose read failed, carries no readings, and the trouble is
    logged once until it clears.
    """

    def __init__(
        self, telemetry: "NvmlTelemetry | EmulatedTelemetry", read_timeout_s: float = HEARTBEAT_READ_TIMEOUT_S
    ):
        self.telemetry = telemetry
        self.read_timeout_s = read_timeout_s
        self._reading: asyncio.Future | None = None
        self._xid_cursor = 0
        self._recent_xids: deque[XidEvent] = deque(maxlen=protocol.MAX_HEARTBEAT_XIDS)
        self._trouble: str | None = None

    async def gpus(self) -> list[dict]:
        # A read still running from an earlier heartbeat is waited on again, never doubled.
        if self._reading is None:
            self._reading = self._read_on_a_thread()
        try:
            readings = await asyncio.wait_for(asyncio.shield(self._reading), self.read_timeout_s)
        except TimeoutError:
            self._failed(f"reading the GPUs took over {self.read_timeout_s} s")
            return []
        except Exception as exc:  # noqa: BLE001 - whatever NVML raises, the heartbeat goes out
            self._reading = None
            self._failed(f"reading the GPUs failed ({exc.__class__.__name__}: {exc})")
            return []
        self._reading = None
        if self._trouble is not None:
            log.info("GPU readings are back in heartbeats")
            self._trouble = None
        return [compact_reading(r) for r in readings]

    def _read_on_a_thread(self) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def settle(readings, error) -> None:
            if future.done():
                return
            if error is None:
                future.set_result(readings)
            else:
                future.set_exception(error)

        def read() -> None:
            try:
                readings, error = self.telemetry.read(), None
            except Exception as exc:  # noqa: BLE001 - handed to the heartbeat, which goes out without readings
                readings, error = None, exc
            try:
                loop.call_soon_threadsafe(settle, readings, error)
            except RuntimeError:  # the loop closed while NVML was stuck
                pass

        threading.Thread(target=read, name="heartbeat-gpu-read", daemon=True).start()
        return future

    def _failed(self, trouble: str) -> None:
        if self._trouble is None:
            log.warning("%s: heartbeats go without GPU readings until it clears", trouble)
        self._trouble = trouble

    def xids(self, now: float | None = None) -> list[dict]:
        """The Xid events of the last XID_WINDOW_S seconds, at most the most recent MAX_HEARTBEAT_XIDS, oldest first."""
        now = time.time() if now is None else now
        events, self._xid_cursor = self.telemetry.xid_events_since(self._xid_cursor)
        self._recent_xids.extend(events)
        cutoff = now - protocol.XID_WINDOW_S
        recent = sorted((e for e in self._recent_xids if e.at >= cutoff), key=lambda e: e.at)
        return [{"at": e.at, "gpu": -1 if e.gpu_index is None else e.gpu_index, "code": e.code} for e in recent]


def compact_reading(reading: GpuReading) -> dict:
    """A reading as a heartbeat carries it: protocol.HEARTBEAT_GPU_FIGURES, None for n/a."""
    return {
        "index": reading.index,
        **{key: getattr(reading, key) for key in protocol.HEARTBEAT_GPU_FIGURES},
        "lost": reading.lost,
    }


# --- Prometheus -------------------------------------------------------------------

LABELS = ["gpu", "UUID", "modelName", "Hostname", "node", "source"]  # dcgm-exporter's labels, plus ours

# (metric, help, value from a reading or None for n/a), DCGM's names and units.
_METRICS: list[tuple[str, str, Callable[[GpuReading], float | None]]] = [
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", lambda r: r.utilization_pct),
    (
        "DCGM_FI_DEV_FB_USED",
        "Framebuffer memory used (in MiB).",
        lambda r: None if r.memory_used_bytes is None else r.memory_used_bytes // MIB,
    ),
    (
        "DCGM_FI_DEV_FB_FREE",
        "Framebuffer memory free (in MiB).",
        lambda r: (
            None
            if r.memory_used_bytes is None or r.memory_total_bytes is None
            else (r.memory_total_bytes - r.memory_used_bytes) // MIB
        ),
    ),
    ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", lambda r: r.temperature_c),
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", lambda r: r.power_w),
    ("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", lambda r: r.sm_clock_mhz),
    ("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered.", lambda r: r.last_xid),
    (
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        "Total number of double-bit volatile ECC errors.",
        lambda r: r.ecc_uncorrected_volatile,
    ),
    ("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "Current clock throttle reasons (bitmask).", lambda r: r.throttle_reasons),
    (
        "DCGM_FI_DEV_ROW_REMAP_FAILURE",
        "Whether remapping of rows has failed.",
        lambda r: None if r.remapped_rows is None else int(r.remapped_rows["failure"]),
    ),
    (
        "lifeline_gpu_nvlink_links_up",
        "NVLink links up on this GPU.",
        lambda r: None if r.nvlink_up is None else sum(r.nvlink_up),
    ),
    ("lifeline_gpu_lost", "1 when the GPU is lost (fallen off the bus or needs a reset).", lambda r: int(r.lost)),
]


class DcgmCollector:
    """Reads the GPUs at scrape time under dcgm-exporter's names, so existing dashboards work.

    A figure the GPU cannot give is left out for that GPU: absence is n/a, a zero would lie.
    """

    def __init__(self, telemetry: NvmlTelemetry | EmulatedTelemetry, hostname: str, node: str = ""):
        self.telemetry = telemetry
        self.hostname = hostname
        self.node = node or hostname

    def collect(self):
        readings = self.telemetry.read()
        for metric, doc, value_of in _METRICS:
            family = GaugeMetricFamily(metric, doc, labels=LABELS)
            for reading in readings:
                value = value_of(reading)
                if value is not None:
                    labels = [
                        str(reading.index),
                        reading.uuid or "",
                        reading.name or "",
                        self.hostname,
                        self.node,
                        reading.source,
                    ]
                    family.add_metric(labels, value)
            if family.samples:
                yield family


# --- command line -----------------------------------------------------------------


def main() -> None:
    """Print what this host's GPUs read, as one JSON document (emulated where there is no GPU)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    deployment = catalog.Deployment.of("Qwen3-32B", "H100-SXM", 1)
    gpus = emulated_gpus(socket.gethostname(), deployment.gpu, deployment.tp)
    idle = {"busy_fraction": 0.0, "kv_bytes_used": 0}
    telemetry = open_telemetry(gpus, deployment, lambda: idle, faults_mod.FaultState(enabled=False))
    try:
        document = {"source": telemetry.source, "gpus": [reading.to_json() for reading in telemetry.read()]}
    finally:
        telemetry.close()
    json.dump(document, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
