"""Injected faults: what an operator rehearses on a staging node.

Off unless the node starts with fault injection enabled, and always behind a
bearer token. The engine reads the slowdowns and silent corruption from
here, telemetry reads the thermal state, Xid and ECC events and NVLink state,
so each fault shows the way the real one would.
"""

import hashlib
import os
import signal
import time
from dataclasses import dataclass, field

from workers import tokens

KINDS = ("crash", "hang", "slow", "sdc", "thermal", "xid", "nvlink_down", "poison", "partition")

# Xid codes whose hardware effect telemetry shows beyond the event itself.
ECC_UNCORRECTED_XIDS = {48, 94, 95}
ROW_REMAP_PENDING_XID = 63
ROW_REMAP_FAILED_XID = 64
GPU_LOST_XID = 79

THERMAL_BASE_C = 45.0
NVLINK_DOWN_TP_FACTOR = 1.0  # see Deployment.tp_comm_s: the link itself changes


class FaultError(ValueError):
    def __init__(self, field_: str, message: str):
        super().__init__(f"{field_}: {message}")
        self.field = field_


@dataclass
class Fault:
    kind: str
    params: dict
    at: float  # epoch seconds

    def to_json(self) -> dict:
        return {"kind": self.kind, "params": self.params, "at": self.at}


@dataclass
class XidInjection:
    at: float
    gpu: int
    code: int


@dataclass
class FaultState:
    """The faults active on this node. `tp` is the node's GPU count."""

    enabled: bool
    tp: int = 1
    active: dict[str, Fault] = field(default_factory=dict)
    xids: list[XidInjection] = field(default_factory=list)
    ecc_uncorrected: dict[int, int] = field(default_factory=dict)
    remapped_rows: dict[int, dict] = field(default_factory=dict)
    lost_gpus: set[int] = field(default_factory=set)

    # --- injection ---------------------------------------------------------------
    def inject(self, kind: str, params: dict, now: float | None = None) -> Fault:
        """Validate and apply one fault; crash and hang act at once (see `act`)."""
        now = time.time() if now is None else now
        if kind not in KINDS:
            raise FaultError("kind", f"{kind!r} is not a fault: expected one of {', '.join(KINDS)}")
        if not isinstance(params, dict):
            raise FaultError("params", "must be an object")
        clean = _validate(kind, params, self.tp)
        fault = Fault(kind, clean, now)
        if kind == "xid":
            for i in range(clean["count"]):
                self._apply_xid(XidInjection(now + i * 0.001, clean["gpu"], clean["code"]))
        elif kind not in ("crash", "hang"):
            self.active[kind] = fault
        return fault

    def clear(self, kind: str | None = None) -> None:
        """End lasting faults (all of them, or one kind). Recorded hardware damage stays."""
        if kind is None:
            self.active.clear()
        else:
            self.active.pop(kind, None)

    def reset_gpus(self) -> None:
        """What a GPU reset does: lasting faults end, lost GPUs come back, volatile ECC counts restart.

        Remapped rows and the Xid history stay: they are the GPUs' history, not their state.
        """
        self.clear()
        self.lost_gpus.clear()
        self.ecc_uncorrected.clear()

    def _apply_xid(self, event: XidInjection) -> None:
        self.xids.append(event)
        if event.code in ECC_UNCORRECTED_XIDS:
            self.ecc_uncorrected[event.gpu] = self.ecc_uncorrected.get(event.gpu, 0) + 1
        rows = self.remapped_rows.setdefault(
            event.gpu, {"correctable": 0, "uncorrectable": 0, "pending": False, "failure": False}
        )
        if event.code == ROW_REMAP_PENDING_XID:
            rows["uncorrectable"] += 1
            rows["pending"] = True
        elif event.code == ROW_REMAP_FAILED_XID:
            rows["failure"] = True
        if event.code == GPU_LOST_XID:
            self.lost_gpus.add(event.gpu)

    def xid_events_since(self, index: int) -> tuple[list[XidInjection], int]:
        return self.xids[index:], len(self.xids)

    # --- effects the engine reads --------------------------------------------------------
    @property
    def gpu_lost(self) -> bool:
        return bool(self.lost_gpus)

    def partitioned(self, now: float | None = None) -> bool:
        """Cut off from the control plane: no registration or heartbeat leaves; the data path is untouched."""
        fault = self.active.get("partition")
        if fault is None:
            return False
        if (time.time() if now is None else now) < fault.at + fault.params["seconds"]:
            return True
        self.active.pop("partition", None)  # healed
        return False

    @property
    def nvlink_down(self) -> bool:
        return "nvlink_down" in self.active

    def thermal_progress(self, now: float | None = None) -> float:
        """0 without a thermal fault; rises to 1 over the fault's ramp."""
        fault = self.active.get("thermal")
        if fault is None:
            return 0.0
        now = time.time() if now is None else now
        ramp = fault.params["ramp_s"]
        return 1.0 if ramp <= 0 else min(max((now - fault.at) / ramp, 0.0), 1.0)

    def clock_factor(self, now: float | None = None) -> float:
        """SM clock as a share of its maximum: thermal throttling lowers it."""
        fault = self.active.get("thermal")
        if fault is None:
            return 1.0
        return 1.0 - (1.0 - fault.params["min_clock_factor"]) * self.thermal_progress(now)

    def step_factor(self, now: float | None = None) -> float:
        """How much longer each engine step takes than the model says."""
        factor = 1.0 / self.clock_factor(now)
        slow = self.active.get("slow")
        if slow is not None:
            factor *= slow.params["factor"]
        return factor

    def poisoned_by(self, prompt_ids: list[int]) -> str | None:
        """A query of death: the engine fails on requests whose prompt holds the fault's text.

        What a tokenizer or kernel bug triggered by one input looks like from
        outside: that request fails on every node with the bug, the others are
        served. Returns the matched text, or None.
        """
        fault = self.active.get("poison")
        if fault is None:
            return None
        needle = fault.params["ids"]
        if not needle:
            return fault.params["match"]
        first, n = needle[0], len(needle)
        for start, token in enumerate(prompt_ids):
            if token == first and prompt_ids[start : start + n] == needle:
                return fault.params["match"]
        return None

    def corrupt(self, state: bytes, position: int, choice: tokens.Choice) -> tokens.Choice:
        """Silent data corruption: at the fault's rate a wrong token, and logprobs that drift."""
        fault = self.active.get("sdc")
        if fault is None:
            return choice
        drift = fault.params["logprob_drift"]
        digest = hashlib.blake2b(state + position.to_bytes(8, "little"), digest_size=8, person=b"lifeline-sdc").digest()
        token_id = choice.token_id
        if int.from_bytes(digest, "little") / 2**64 < fault.params["rate"]:
            token_id = (choice.token_id + 1 + digest[0]) % tokens.WORD_COUNT
        top = tuple((t, lp + drift) for t, lp in choice.top)
        return tokens.Choice(token_id, choice.logprob + drift, top)

    def to_json(self) -> dict:
        return {
            "enabled": self.enabled,
            "active": [f.to_json() for f in self.active.values()],
            "xids": [{"at": x.at, "gpu": x.gpu, "code": x.code} for x in self.xids[-50:]],
            "lost_gpus": sorted(self.lost_gpus),
        }


def act(fault: Fault) -> None:
    """The faults that take the process itself: crash exits at once, hang freezes it."""
    if fault.kind == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.kind == "hang":
        # Block the event loop: no answers, no heartbeats, yet every socket stays open.
        deadline = time.monotonic() + fault.params["seconds"]
        while time.monotonic() < deadline:
            time.sleep(0.05)


def _number(params: dict, key: str, default, low: float, high: float, kind=float):
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise FaultError(key, f"must be a{'n integer' if kind is int else ' number'}")
    if not low <= value <= high:
        raise FaultError(key, f"must be between {low} and {high}")
    return kind(value)


def _validate(kind: str, params: dict, tp: int) -> dict:
    if kind == "crash":
        return {}
    if kind == "hang":
        return {"seconds": _number(params, "seconds", 3600.0, 0.1, 86400.0)}
    if kind == "slow":
        return {"factor": _number(params, "factor", 3.0, 1.0, 100.0)}
    if kind == "sdc":
        return {
            "rate": _number(params, "rate", 0.05, 0.0, 1.0),
            "logprob_drift": _number(params, "logprob_drift", -1.5, -20.0, 20.0),
        }
    if kind == "thermal":
        return {
            "target_c": _number(params, "target_c", 92.0, 50.0, 120.0),
            "ramp_s": _number(params, "ramp_s", 20.0, 0.0, 3600.0),
            "min_clock_factor": _number(params, "min_clock_factor", 0.55, 0.1, 1.0),
        }
    if kind == "xid":
        if "code" not in params:
            raise FaultError("code", "is required: the Xid code to raise, e.g. 48 or 79")
        return {
            "code": _number(params, "code", None, 1, 999, int),
            "gpu": _number(params, "gpu", 0, 0, max(tp - 1, 0), int),
            "count": _number(params, "count", 1, 1, 1000, int),
        }
    if kind == "poison":
        match = params.get("match", "")
        if not isinstance(match, str):
            raise FaultError("match", 'must be the text that makes the engine fail, or "" for every request')
        return {"match": match, "ids": tokens.encode(match)}
    if kind == "partition":
        return {"seconds": _number(params, "seconds", 30.0, 0.1, 86400.0)}
    if kind == "nvlink_down":
        if tp < 2:
            raise FaultError(
                "kind", "nvlink_down needs a tensor-parallel group: this node has one GPU and no NVLink peers"
            )
        return {}
    raise FaultError("kind", f"{kind!r} is not a fault")
