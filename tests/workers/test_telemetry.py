"""GPU telemetry: the NVML seam, the emulated figures, and the DCGM-named export.

There is no GPU here, so the real NVML path is tested against a fake of our
own seam (`workers.nvml.Nvml`), never a fake pynvml; the seam's own error
mapping is checked once with a stand-in module raising pynvml's real errors.
"""

import json
import logging
import queue
import subprocess
import sys
import threading
import time
import types

import pynvml
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from tests.helpers import BASE_DIR
from workers import catalog
from workers.faults import FaultState
from workers.nvml import GpuLost, NotSupported, Nvml, NvmlError, NvmlUnavailable
from workers.protocol import HEARTBEAT_GPU_FIGURES, GpuInfo
from workers.telemetry import (
    BOARDS,
    DcgmCollector,
    EmulatedTelemetry,
    HeartbeatTelemetry,
    NvmlTelemetry,
    XidEvent,
    open_telemetry,
)

IDLE = {"busy_fraction": 0.0, "kv_bytes_used": 0}
THERMAL_BITS = 0x20 | 0x40


def _gpus(deployment: catalog.Deployment) -> tuple[GpuInfo, ...]:
    gpu = deployment.gpu
    return tuple(GpuInfo(i, f"GPU-emulated-{i}", gpu.name, gpu.memory_bytes) for i in range(deployment.tp))


def _emulated(model="Qwen3-32B", gpu="H100-SXM", tp=1, load=IDLE):
    deployment = catalog.Deployment.of(model, gpu, tp)
    faults = FaultState(enabled=True, tp=tp)
    return EmulatedTelemetry(_gpus(deployment), deployment, lambda: load, faults), faults


def _samples(telemetry) -> dict[tuple[str, str], float]:
    """{(metric, gpu index): value} as the collector yields them."""
    samples = {}
    for family in DcgmCollector(telemetry, "node-01").collect():
        for sample in family.samples:
            samples[sample.name, sample.labels["gpu"]] = sample.value
    return samples


def _exposition(telemetry) -> str:
    registry = CollectorRegistry()
    registry.register(DcgmCollector(telemetry, "node-01"))
    return generate_latest(registry).decode()


def _eventually(predicate, timeout=2.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


# --- no GPU here: the real library ------------------------------------------------


def test_without_a_gpu_open_telemetry_serves_emulated_figures_and_says_so_once(caplog):
    try:
        Nvml().init()
    except NvmlUnavailable:
        pass
    else:
        pytest.skip("this host has a GPU: NVML initialised")
    deployment = catalog.Deployment.of("Qwen3-32B", "H100-SXM", 1)
    caplog.set_level(logging.INFO, logger="workers.telemetry")

    telemetry = open_telemetry(_gpus(deployment), deployment, lambda: IDLE, FaultState(enabled=False))

    assert isinstance(telemetry, EmulatedTelemetry)
    lines = [r for r in caplog.records if r.name == "workers.telemetry"]
    assert len(lines) == 1
    assert lines[0].levelno == logging.INFO
    assert "no GPU" in lines[0].getMessage() and "source: emulated" in lines[0].getMessage()
    [reading] = telemetry.read()
    assert reading.source == "emulated" and reading.uuid == "GPU-emulated-0"
    assert json.loads(json.dumps(reading.to_json()))["source"] == "emulated"


def test_command_line_prints_one_json_document():
    result = subprocess.run(
        [sys.executable, "-m", "workers.telemetry"], cwd=BASE_DIR, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["source"] == "emulated"
    assert [g["source"] for g in document["gpus"]] == ["emulated"]
    assert "no GPU" in result.stderr


# --- emulated figures ---------------------------------------------------------------


def test_idle_and_busy_gpus_differ_in_utilization_power_and_temperature():
    load = dict(IDLE)
    telemetry, _ = _emulated(load=load)
    [idle] = telemetry.read()
    load.update(busy_fraction=0.9, kv_bytes_used=10 * 10**9)
    [busy] = telemetry.read()

    assert idle.utilization_pct == 0 and idle.throttle_reasons == 0x1
    assert idle.power_w == pytest.approx(0.12 * 700) and idle.power_limit_w == 700
    assert idle.temperature_c == 45
    assert busy.utilization_pct == pytest.approx(90) and busy.throttle_reasons == 0
    assert idle.power_w < busy.power_w < 700
    assert busy.temperature_c == pytest.approx(45 + 27)
    weights = catalog.model("Qwen3-32B").weight_bytes
    assert idle.memory_used_bytes == weights + 2 * 10**9
    assert busy.memory_used_bytes == weights + 12 * 10**9
    assert busy.sm_clock_mhz == busy.sm_clock_max_mhz == 1980


def test_memory_used_is_capped_at_the_gpus_memory():
    telemetry, _ = _emulated(load={"busy_fraction": 1.0, "kv_bytes_used": 10**12})
    [reading] = telemetry.read()
    assert reading.memory_used_bytes == reading.memory_total_bytes == 80 * 10**9


def test_thermal_fault_reaches_its_target_and_throttles_the_clock():
    telemetry, faults = _emulated()
    faults.inject("thermal", {"ramp_s": 0})
    [reading] = telemetry.read()
    assert reading.temperature_c == 92
    assert reading.sm_clock_mhz == round(1980 * 0.55) < reading.sm_clock_max_mhz
    assert reading.throttle_reasons & THERMAL_BITS == THERMAL_BITS
    assert _samples(telemetry)["DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "0"] == 0x1 | THERMAL_BITS


def test_xid_48_counts_an_ecc_error_and_is_reported_with_the_gpus_uuid():
    telemetry, faults = _emulated(tp=2)
    assert telemetry.read()[1].ecc_uncorrected_volatile == 0
    assert ("DCGM_FI_DEV_XID_ERRORS", "1") not in _samples(telemetry)

    faults.inject("xid", {"code": 48, "gpu": 1})

    gpu0, gpu1 = telemetry.read()
    assert gpu1.ecc_uncorrected_volatile == 1 and gpu1.last_xid == 48
    assert gpu0.ecc_uncorrected_volatile == 0 and gpu0.last_xid is None
    events, cursor = telemetry.xid_events_since(0)
    assert [(e.gpu_index, e.gpu_uuid, e.code) for e in events] == [(1, "GPU-emulated-1", 48)]
    assert isinstance(events[0], XidEvent)
    assert telemetry.xid_events_since(cursor) == ([], cursor)
    samples = _samples(telemetry)
    assert samples["DCGM_FI_DEV_XID_ERRORS", "1"] == 48
    assert samples["DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "1"] == 1
    assert ("DCGM_FI_DEV_XID_ERRORS", "0") not in samples


def test_xid_79_makes_that_gpu_lost_and_its_figures_absent():
    telemetry, faults = _emulated(tp=2)
    faults.inject("xid", {"code": 79, "gpu": 1})

    gpu0, gpu1 = telemetry.read()
    assert not gpu0.lost and gpu0.utilization_pct is not None
    assert gpu1.lost and gpu1.uuid == "GPU-emulated-1"
    figures = {
        k: v for k, v in gpu1.to_json().items() if k not in ("index", "uuid", "name", "source", "lost", "last_xid")
    }
    assert set(figures.values()) == {None}

    samples = _samples(telemetry)
    assert samples["lifeline_gpu_lost", "1"] == 1 and samples["lifeline_gpu_lost", "0"] == 0
    assert samples["DCGM_FI_DEV_XID_ERRORS", "1"] == 79  # the event says why it is lost
    assert {name for name, gpu in samples if gpu == "1"} == {"lifeline_gpu_lost", "DCGM_FI_DEV_XID_ERRORS"}


def test_nvlink_down_turns_every_link_off():
    telemetry, faults = _emulated(tp=2)
    assert [r.nvlink_up for r in telemetry.read()] == [[True] * 18] * 2
    faults.inject("nvlink_down", {})
    assert [r.nvlink_up for r in telemetry.read()] == [[False] * 18] * 2
    assert _samples(telemetry)["lifeline_gpu_nvlink_links_up", "0"] == 0


def test_consumer_card_reports_no_ecc_rows_or_nvlink_as_absent_not_zero():
    telemetry, _ = _emulated(model="Llama-3-8B", gpu="RTX-4090")
    [reading] = telemetry.read()
    assert reading.ecc_uncorrected_volatile is None and reading.remapped_rows is None and reading.nvlink_up is None
    text = _exposition(telemetry)
    assert "DCGM_FI_DEV_GPU_UTIL{" in text
    for absent in ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "DCGM_FI_DEV_ROW_REMAP_FAILURE", "lifeline_gpu_nvlink_links_up"):
        assert absent not in text


def test_collector_uses_dcgm_exporter_labels_and_units():
    telemetry, _ = _emulated()
    text = _exposition(telemetry)
    assert (
        'DCGM_FI_DEV_FB_USED{Hostname="node-01",UUID="GPU-emulated-0",gpu="0",'
        'modelName="NVIDIA H100 80GB HBM3",node="node-01",source="emulated"}' in text
    )
    samples = _samples(telemetry)
    [reading] = telemetry.read()
    assert (
        samples["DCGM_FI_DEV_FB_USED", "0"] + samples["DCGM_FI_DEV_FB_FREE", "0"] == reading.memory_total_bytes // 2**20
    )


def test_every_catalog_gpu_has_a_board_and_nvlink_only_off_pcie():
    assert set(BOARDS) == set(catalog.GPUS)
    for key, board in BOARDS.items():
        assert (board.nvlinks > 0) == (catalog.GPUS[key].link != "pcie"), key
    assert BOARDS["A100-80GB"].nvlinks == 12


# --- NVML through a fake of our seam --------------------------------------------------


class FakeNvml:
    """Our seam with two H100s behind it. Handles are indices; `errors` makes readings fail."""

    def __init__(self, count: int = 2):
        self.count = count
        self.errors: dict[tuple[int, str], NvmlError] = {}
        self.lost: set[int] = set()
        self.events: queue.Queue = queue.Queue()
        self.shut_down = False
        self.freed = False

    def _answer(self, handle, reading, value):
        if handle in self.lost:
            raise GpuLost("GPU is lost", 15)
        if (handle, reading) in self.errors:
            raise self.errors[handle, reading]
        return value

    def init(self):
        pass

    def shutdown(self):
        self.shut_down = True

    def device_count(self):
        return self.count

    def handle(self, index):
        return self._answer(index, "handle", index)

    def uuid(self, h):
        return self._answer(h, "uuid", f"GPU-fake-{h}")

    def name(self, h):
        return self._answer(h, "name", "NVIDIA H100 80GB HBM3")

    def memory(self, h):
        return self._answer(h, "memory", (20 * 2**30, 80 * 2**30))

    def utilization_pct(self, h):
        return self._answer(h, "utilization_pct", 57.0)

    def temperature_c(self, h):
        return self._answer(h, "temperature_c", 61.0)

    def power_w(self, h):
        return self._answer(h, "power_w", 412.5)

    def power_limit_w(self, h):
        return self._answer(h, "power_limit_w", 700.0)

    def sm_clock_mhz(self, h):
        return self._answer(h, "sm_clock_mhz", 1755)

    def sm_clock_max_mhz(self, h):
        return self._answer(h, "sm_clock_max_mhz", 1980)

    def throttle_reasons(self, h):
        return self._answer(h, "throttle_reasons", 0)

    def ecc_uncorrected_volatile(self, h):
        return self._answer(h, "ecc_uncorrected_volatile", 0)

    def remapped_rows(self, h):
        return self._answer(
            h, "remapped_rows", {"correctable": 0, "uncorrectable": 0, "pending": False, "failure": False}
        )

    def nvlink_up(self, h):
        return self._answer(h, "nvlink_up", [True] * 18)

    def xid_event_set(self, handles):
        return "event-set"

    def free_event_set(self, event_set):
        self.freed = True

    def wait_xid(self, event_set, timeout_ms):
        try:
            return self.events.get(timeout=min(timeout_ms / 1000, 0.02))
        except queue.Empty:
            return None


def test_open_telemetry_uses_nvml_where_it_starts():
    fake = FakeNvml()
    deployment = catalog.Deployment.of("Qwen3-32B", "H100-SXM", 1)
    telemetry = open_telemetry(_gpus(deployment), deployment, lambda: IDLE, FaultState(enabled=False), nvml=fake)
    assert isinstance(telemetry, NvmlTelemetry)
    assert telemetry.gpus() == (
        GpuInfo(0, "GPU-fake-0", "NVIDIA H100 80GB HBM3", 80 * 2**30),
        GpuInfo(1, "GPU-fake-1", "NVIDIA H100 80GB HBM3", 80 * 2**30),
    )
    reading = telemetry.read()[0]
    assert reading.source == "nvml" and reading.utilization_pct == 57 and reading.memory_used_bytes == 20 * 2**30


def test_open_telemetry_falls_back_with_a_warning_when_nvml_fails_otherwise(caplog):
    class BrokenNvml(FakeNvml):
        def init(self):
            raise NvmlError("Unknown Error", 999)

    deployment = catalog.Deployment.of("Qwen3-32B", "H100-SXM", 1)
    telemetry = open_telemetry(
        _gpus(deployment), deployment, lambda: IDLE, FaultState(enabled=False), nvml=BrokenNvml()
    )
    assert isinstance(telemetry, EmulatedTelemetry)
    assert [r.levelno for r in caplog.records if r.name == "workers.telemetry"] == [logging.WARNING]


def test_nvml_feature_a_gpu_lacks_reads_as_none():
    fake = FakeNvml()
    fake.errors[0, "ecc_uncorrected_volatile"] = NotSupported("Not Supported", 3)
    telemetry = NvmlTelemetry(fake)
    gpu0, gpu1 = telemetry.read()
    assert gpu0.ecc_uncorrected_volatile is None and gpu0.temperature_c == 61
    assert gpu1.ecc_uncorrected_volatile == 0
    assert ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "0") not in _samples(telemetry)


def test_nvml_lost_gpu_is_a_reading_not_an_exception():
    fake = FakeNvml()
    telemetry = NvmlTelemetry(fake)
    fake.lost.add(1)
    gpu0, gpu1 = telemetry.read()
    assert not gpu0.lost and gpu0.power_w == 412.5
    assert gpu1.lost and gpu1.uuid == "GPU-fake-1" and gpu1.power_w is None
    assert _samples(telemetry)["lifeline_gpu_lost", "1"] == 1
    assert len(telemetry.gpus()) == 2  # identities read at start stay known


def test_nvml_xid_events_reach_readers_and_close_stops_the_thread():
    fake = FakeNvml()
    telemetry = NvmlTelemetry(fake)
    telemetry.start()
    fake.events.put(("GPU-fake-1", 79))
    fake.events.put((0, 48))  # the seam gives the index when the UUID cannot be read

    _eventually(lambda: len(telemetry.xid_events_since(0)[0]) == 2)
    events, cursor = telemetry.xid_events_since(0)
    assert [(e.gpu_index, e.gpu_uuid, e.code) for e in events] == [(1, "GPU-fake-1", 79), (0, "GPU-fake-0", 48)]
    assert telemetry.xid_events_since(cursor) == ([], 2)
    assert [r.last_xid for r in telemetry.read()] == [48, 79]

    telemetry.close()
    assert not any(t.name == "nvml-xid-events" for t in threading.enumerate())
    assert fake.freed and fake.shut_down


# --- the seam itself, against pynvml's real error classes -------------------------------


def _standin(**functions) -> types.SimpleNamespace:
    """pynvml's constants and error classes, with the functions that would reach the driver replaced."""
    module = types.SimpleNamespace(**vars(pynvml))
    vars(module).update(functions)
    return module


def _raise(error_class):
    def call(*args):
        raise error_class()

    return call


def test_seam_maps_nvml_errors_to_our_three_meanings():
    cases = [
        ("init", "nvmlInit", pynvml.NVMLError_LibraryNotFound, NvmlUnavailable),
        ("init", "nvmlInit", pynvml.NVMLError_DriverNotLoaded, NvmlUnavailable),
        ("ecc_uncorrected_volatile", "nvmlDeviceGetTotalEccErrors", pynvml.NVMLError_NotSupported, NotSupported),
        ("temperature_c", "nvmlDeviceGetTemperature", pynvml.NVMLError_GpuIsLost, GpuLost),
        ("power_w", "nvmlDeviceGetPowerUsage", pynvml.NVMLError_ResetRequired, GpuLost),
        ("memory", "nvmlDeviceGetMemoryInfo", pynvml.NVMLError_NoPermission, NvmlError),
    ]
    for method, function, raised, expected in cases:
        nvml = Nvml(module=_standin(**{function: _raise(raised)}))
        args = () if method == "init" else ("handle",)
        with pytest.raises(expected) as caught:
            getattr(nvml, method)(*args)
        assert type(caught.value) is expected and caught.value.code == raised().value, (method, raised)


def test_seam_shapes_links_events_and_units():
    def link_state(handle, link):
        if handle == "pcie":
            raise pynvml.NVMLError_NotSupported()
        if link >= 18:
            raise pynvml.NVMLError_InvalidArgument()
        return 1

    waits = iter(
        [
            pynvml.NVMLError_Timeout(),
            types.SimpleNamespace(device="h1", eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=79),
        ]
    )

    def wait(event_set, timeout_ms):
        result = next(waits)
        if isinstance(result, Exception):
            raise result
        return result

    module = _standin(
        nvmlDeviceGetNvLinkState=link_state,
        nvmlEventSetWait=wait,
        nvmlDeviceGetUUID=lambda h: b"GPU-1234",
        nvmlDeviceGetPowerUsage=lambda h: 412_500,
        nvmlDeviceGetCurrentClocksThrottleReasons=lambda h: 0x60,
    )
    del module.nvmlDeviceGetCurrentClocksEventReasons  # an older nvidia-ml-py
    del module.nvmlDeviceGetRemappedRows  # older still
    nvml = Nvml(module=module)

    assert nvml.nvlink_up("sxm") == [True] * 18
    assert nvml.nvlink_up("pcie") is None
    assert nvml.power_w("h") == 412.5
    assert nvml.throttle_reasons("h") == 0x60
    with pytest.raises(NotSupported):
        nvml.remapped_rows("h")
    assert nvml.wait_xid("event-set", 500) is None
    assert nvml.wait_xid("event-set", 500) == ("GPU-1234", 79)


# --- what heartbeats carry ------------------------------------------------------------


async def test_heartbeat_readings_are_compact_and_what_a_gpu_lacks_stays_null():
    consumer, _ = _emulated(model="Llama-3-8B", gpu="RTX-4090")
    [reading] = await HeartbeatTelemetry(consumer).gpus()
    assert set(reading) == {"index", "lost", *HEARTBEAT_GPU_FIGURES}
    assert reading["ecc_uncorrected_volatile"] is None and reading["temperature_c"] == 45 and reading["lost"] is False

    telemetry, faults = _emulated(tp=2)
    faults.inject("xid", {"code": 79, "gpu": 1})
    working, lost = await HeartbeatTelemetry(telemetry).gpus()
    assert working["ecc_uncorrected_volatile"] == 0 and working["utilization_pct"] == 0  # a real zero: idle
    assert lost["lost"] is True and {lost[k] for k in HEARTBEAT_GPU_FIGURES} == {None}


def test_heartbeat_xids_are_the_last_two_minutes_at_most_a_hundred_oldest_first():
    telemetry, faults = _emulated(tp=2)
    heartbeat = HeartbeatTelemetry(telemetry)
    now = time.time()
    assert heartbeat.xids(now) == []
    faults.inject("xid", {"code": 31, "gpu": 0}, now=now - 121)  # too old to send
    faults.inject("xid", {"code": 48, "gpu": 1, "count": 3}, now=now - 10)
    assert heartbeat.xids(now) == [{"at": now - 10 + i * 0.001, "gpu": 1, "code": 48} for i in range(3)]
    assert heartbeat.xids(now) == heartbeat.xids(now)  # sent again while recent
    assert heartbeat.xids(now + 111) == []  # two minutes on, they are history

    faults.inject("xid", {"code": 13, "gpu": 0, "count": 130}, now=now)
    xids = heartbeat.xids(now + 1)
    assert (
        len(xids) == 100
        and xids[0]["at"] == pytest.approx(now + 0.030)
        and xids[-1]["at"] == pytest.approx(now + 0.129)
    )
    assert [x["at"] for x in xids] == sorted(x["at"] for x in xids)


def test_heartbeat_xid_from_a_gpu_nvml_could_not_locate_has_gpu_minus_one():
    fake = FakeNvml()
    telemetry = NvmlTelemetry(fake)
    telemetry.start()
    try:
        fake.events.put(("GPU-not-on-this-host", 79))
        _eventually(lambda: telemetry.xid_events_since(0)[0])
        [xid] = HeartbeatTelemetry(telemetry).xids()
        assert xid["gpu"] == -1 and xid["code"] == 79
    finally:
        telemetry.close()


class FlakyTelemetry:
    """Reads fail while `broken` is set, or block while `hold` is clear."""

    source = "nvml"

    def __init__(self):
        self.inner, _ = _emulated()
        self.broken = False
        self.hold = threading.Event()
        self.hold.set()
        self.reads = 0

    def read(self):
        self.reads += 1
        self.hold.wait(10)
        if self.broken:
            raise NvmlError("Unknown Error", 999)
        return self.inner.read()

    def xid_events_since(self, cursor):
        return self.inner.xid_events_since(cursor)


async def test_a_failing_gpu_read_sends_no_readings_and_is_logged_once(caplog):
    caplog.set_level(logging.INFO, logger="workers.telemetry")
    telemetry = FlakyTelemetry()
    heartbeat = HeartbeatTelemetry(telemetry)
    assert len(await heartbeat.gpus()) == 1
    telemetry.broken = True
    assert [await heartbeat.gpus() for _ in range(3)] == [[], [], []]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "Unknown Error" in warnings[0]
    telemetry.broken = False
    assert len(await heartbeat.gpus()) == 1
    assert "back" in caplog.records[-1].getMessage()


async def test_a_hung_gpu_read_does_not_hold_up_heartbeats_or_pile_up():
    telemetry = FlakyTelemetry()
    heartbeat = HeartbeatTelemetry(telemetry, read_timeout_s=0.05)
    telemetry.hold.clear()  # NVML blocks, as on a GPU falling off the bus
    started = time.monotonic()
    assert await heartbeat.gpus() == [] and await heartbeat.gpus() == []
    assert time.monotonic() - started < 1
    assert telemetry.reads == 1  # the second heartbeat waited on the same read
    telemetry.hold.set()
    assert len(await heartbeat.gpus()) == 1
