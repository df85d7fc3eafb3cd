"""The one seam between Lifeline and NVML (nvidia-ml-py, import name `pynvml`).

Every pynvml call Lifeline makes goes through `Nvml`, so tests replace this
class and never pynvml itself, and the rest of the code sees three meanings
instead of thirty error codes: no GPU here, the GPU lacks the feature, the
GPU is broken.
"""

# NVML return codes (nvml.h); pynvml raises NVMLError subclasses carrying them as `.value`.
_INVALID_ARGUMENT = 2
_NOT_SUPPORTED = 3
_DRIVER_NOT_LOADED = 9
_TIMEOUT = 10
_LIBRARY_NOT_FOUND = 12
_FUNCTION_NOT_FOUND = 13
_GPU_IS_LOST = 15
_RESET_REQUIRED = 16

# Xid 48 is the double-bit ECC error: NVML sends it as its own event type with eventData 0.
_DOUBLE_BIT_ECC_XID = 48


class NvmlError(Exception):
    """An NVML call failed; `code` is NVML's return code (None when not from NVML)."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.code = code


class NvmlUnavailable(NvmlError):
    """No GPU here (no NVML library, no driver): serve emulated telemetry, nothing is broken."""


class NotSupported(NvmlError):
    """This GPU lacks the feature (ECC on consumer cards, NVLink on PCIe cards): show n/a, never zero."""


class GpuLost(NvmlError):
    """The GPU fell off the bus or needs a reset (Xid 79 and kin): a fault to act on."""


def _translate(exc: Exception) -> NvmlError:
    code = getattr(exc, "value", None)
    message = str(exc)
    if code in (_LIBRARY_NOT_FOUND, _DRIVER_NOT_LOADED):
        return NvmlUnavailable(message, code)
    # A driver older than the function is the same, to the operator, as a SKU without the feature.
    if code in (_NOT_SUPPORTED, _FUNCTION_NOT_FOUND):
        return NotSupported(message, code)
    if code in (_GPU_IS_LOST, _RESET_REQUIRED):
        return GpuLost(message, code)
    return NvmlError(message, code)


def _text(value) -> str:
    """Older nvidia-ml-py returns bytes for names and UUIDs, newer returns str."""
    return value.decode() if isinstance(value, bytes) else value


class Nvml:
    """Thin wrapper over pynvml: one method per reading, NVML errors mapped to ours."""

    def __init__(self, module=None):
        self._module = module

    @property
    def lib(self):
        # Imported lazily: importing workers must not need the NVIDIA library, and tests pass a stand-in.
        if self._module is None:
            try:
                import pynvml
            except ImportError as exc:
                raise NvmlUnavailable(f"nvidia-ml-py is not installed ({exc})") from exc
            self._module = pynvml
        return self._module

    def _call(self, name: str, *args):
        lib = self.lib
        function = getattr(lib, name, None)
        if function is None:
            raise NotSupported(f"{name} is not in the installed nvidia-ml-py")
        try:
            return function(*args)
        except lib.NVMLError as exc:
            raise _translate(exc) from exc

    # --- lifetime and enumeration ------------------------------------------------
    def init(self) -> None:
        self._call("nvmlInit")

    def shutdown(self) -> None:
        self._call("nvmlShutdown")

    def device_count(self) -> int:
        return int(self._call("nvmlDeviceGetCount"))

    def handle(self, index: int):
        return self._call("nvmlDeviceGetHandleByIndex", index)

    # --- readings ------------------------------------------------------------------
    def uuid(self, handle) -> str:
        return _text(self._call("nvmlDeviceGetUUID", handle))

    def name(self, handle) -> str:
        return _text(self._call("nvmlDeviceGetName", handle))

    def index(self, handle) -> int:
        return int(self._call("nvmlDeviceGetIndex", handle))

    def memory(self, handle) -> tuple[int, int]:
        """(used_bytes, total_bytes)."""
        info = self._call("nvmlDeviceGetMemoryInfo", handle)
        return int(info.used), int(info.total)

    def utilization_pct(self, handle) -> float:
        return float(self._call("nvmlDeviceGetUtilizationRates", handle).gpu)

    def temperature_c(self, handle) -> float:
        return float(self._call("nvmlDeviceGetTemperature", handle, self.lib.NVML_TEMPERATURE_GPU))

    def power_w(self, handle) -> float:
        return self._call("nvmlDeviceGetPowerUsage", handle) / 1000  # NVML reports milliwatts

    def power_limit_w(self, handle) -> float:
        return self._call("nvmlDeviceGetEnforcedPowerLimit", handle) / 1000  # milliwatts

    def sm_clock_mhz(self, handle) -> int:
        return int(self._call("nvmlDeviceGetClockInfo", handle, self.lib.NVML_CLOCK_SM))

    def sm_clock_max_mhz(self, handle) -> int:
        return int(self._call("nvmlDeviceGetMaxClockInfo", handle, self.lib.NVML_CLOCK_SM))

    def throttle_reasons(self, handle) -> int:
        """Clock event bitmask; nvidia-ml-py renamed "throttle" to "clocks event" (same bits)."""
        name = "nvmlDeviceGetCurrentClocksEventReasons"
        if not hasattr(self.lib, name):
            name = "nvmlDeviceGetCurrentClocksThrottleReasons"
        return int(self._call(name, handle))

    def ecc_uncorrected_volatile(self, handle) -> int:
        lib = self.lib
        return int(
            self._call(
                "nvmlDeviceGetTotalEccErrors", handle, lib.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, lib.NVML_VOLATILE_ECC
            )
        )

    def remapped_rows(self, handle) -> dict:
        correctable, uncorrectable, pending, failure = self._call("nvmlDeviceGetRemappedRows", handle)
        return {
            "correctable": int(correctable),
            "uncorrectable": int(uncorrectable),
            "pending": bool(pending),
            "failure": bool(failure),
        }

    def nvlink_up(self, handle) -> list[bool] | None:
        """State of each NVLink; None for a card without NVLink (NotSupported on link 0)."""
        lib = self.lib
        links = []
        for link in range(lib.NVML_NVLINK_MAX_LINKS):
            try:
                links.append(bool(lib.nvmlDeviceGetNvLinkState(handle, link)))
            except lib.NVMLError as exc:
                # The library's maximum exceeds what most GPUs have: the first missing link ends the list.
                if getattr(exc, "value", None) in (_NOT_SUPPORTED, _INVALID_ARGUMENT):
                    break
                raise _translate(exc) from exc
        return links or None

    # --- Xid events ----------------------------------------------------------------
    def xid_event_set(self, handles):
        """An event set for Xid and double-bit ECC events of the given GPUs.

        A GPU that cannot deliver events (unsupported, or already lost) is left
        out, so one bad GPU does not blind us to the others.
        """
        lib = self.lib
        event_set = self._call("nvmlEventSetCreate")
        kinds = lib.nvmlEventTypeXidCriticalError | lib.nvmlEventTypeDoubleBitEccError
        for handle in handles:
            try:
                self._call("nvmlDeviceRegisterEvents", handle, kinds, event_set)
            except (NotSupported, GpuLost):
                continue
        return event_set

    def free_event_set(self, event_set) -> None:
        self._call("nvmlEventSetFree", event_set)

    def wait_xid(self, event_set, timeout_ms: int) -> tuple[str | int | None, int] | None:
        """Wait for one event: (GPU UUID, or its index when the UUID cannot be read, Xid code); None on timeout."""
        lib = self.lib
        try:
            event = lib.nvmlEventSetWait(event_set, timeout_ms)
        except lib.NVMLError as exc:
            if getattr(exc, "value", None) == _TIMEOUT:
                return None
            raise _translate(exc) from exc
        code = int(event.eventData)
        if event.eventType == lib.nvmlEventTypeDoubleBitEccError and code == 0:
            code = _DOUBLE_BIT_ECC_XID
        try:
            return self.uuid(event.device), code
        except NvmlError:
            pass
        try:
            return self.index(event.device), code
        except NvmlError:
            return None, code
