"""The attention worker's side of the MoE datapath (document 001's REFE, §4.1 and §5.1): at each layer, each
token's selected experts are resolved through the AW's copy of the expert routing table and its activation sent
to the EWs that hold them; the layer completes when every selected expert has answered.

Failure probing on the data path (TARRAGON §5.1): while the AW waits on an EW's answer it probes that EW every
`probe_every_s` (10 ms). A refused or broken connection is a dead EW at once; `probe_misses` probes in a row left
unanswered (a hung process: its kernel still accepts connections) take it as down too, without waiting for the
answer's own timeout. The tokens it held are then replayed at once on the next location of each expert (a live
primary, else a shadow), marked as a replay so the EW runs them first. An EW taken as down only for its silence is
probed in the background (`readmit_every_s`) and used again when it answers: on a loaded host a live EW can miss
a few 10 ms probes, and that costs a replay, not the EW. An EW that answers its probes but not its layer within
`answer_timeout_s` is tried again, up to MAX_MISSES times in a layer.

An expert with no live location left raises `NoLocation`, naming it: the AW waits for the control plane's next
table (`update`) rather than skip the expert. Answers are pure functions of their inputs (`workers.moe`), so a
replayed layer gives the same output as the first try would have.
"""

import asyncio
import logging
import time
from dataclasses import dataclass, field

import aiohttp

from workers.catalog import Model
from workers.moe import ExpertRoutingTable, MoeError, activation_bytes, combine, expert_output, gate

log = logging.getLogger(__name__)
WRONG = "wrong_answer"  # what _send returns for an answer it refused
REFUSED = "refused"  # what _send returns when the EW refused the tokens (it does not hold those experts)
DEAD = "dead"  # what _watched returns when a probe found the EW's connection refused or broken
SILENT = "silent"  # what _watched returns when `probe_misses` probes in a row went unanswered
OUTPUT_BYTES = 16  # an expert output's digest (workers.moe.expert_output)
MAX_MISSES = 3  # answers an EW that still answers its probe may miss in one layer before it is taken as down


class NoLocation(MoeError):
    """Every EW holding an expert is down for this AW."""

    def __init__(self, expert: int, tried: tuple[str, ...]):
        super().__init__("ert", f"expert {expert} has no live location (tried {', '.join(tried) or 'none'})")
        self.expert = expert


@dataclass
class Refe:
    model: Model
    ert: ExpertRoutingTable
    addresses: dict[str, str]  # EW name -> base URL
    session: aiohttp.ClientSession
    answer_timeout_s: float = 0.25
    probe_timeout_s: float = 0.05
    probe_every_s: float = 0.01  # TARRAGON's data-path probing period
    probe_misses: int = 5  # probes in a row left unanswered that take a waited-on EW as down (hung)
    readmit_every_s: float = 0.1
    down: set[str] = field(default_factory=set)
    silent: set[str] = field(default_factory=set)  # down only for unanswered probes: used again once one answers
    readmitted: int = 0
    back: asyncio.Event = field(default_factory=asyncio.Event)  # set when an EW taken as down is used again
    failovers: list[dict] = field(default_factory=list)  # one per EW found down: when, which, what was replayed
    sent: dict[str, int] = field(default_factory=dict)  # tokens per EW
    link_bytes: int = 0  # activations out and expert outputs back, accounted in full (DESIGN.md contract 3)
    wrong_answers: int = 0  # answers refused: the wrong shape, or for another layer
    # The emulator's ground truth, per EW: answers that differ from the expert's pure function (silent corruption).
    # A real AW cannot tell and merges them as this one does; the canaries are what find such an EW.
    mismatches: dict[str, int] = field(default_factory=dict)
    refusals: dict[str, int] = field(default_factory=dict)  # dispatches an EW refused (400), per EW
    # The baseline the table is measured against (benchmarks.moe_fleet): each expert bound to its first primary of
    # the first table for good; no probing, no failover, no updates.
    static: bool = False
    _background: set = field(default_factory=set)  # the re-admission probes running
    _binding: dict = field(default_factory=dict)  # expert -> EW, when static

    def update(self, ert: ExpertRoutingTable, addresses: dict[str, str] | None = None) -> bool:
        """Take the control plane's newer table (an older or equal version is ignored)."""
        if self.static or ert.model != self.ert.model or ert.version <= self.ert.version:
            return False
        self.ert = ert
        self.addresses.update(addresses or {})
        self.down -= set(addresses or {})  # an EW given anew (a replacement at an address) is tried again
        self.silent &= self.down
        return True

    def close(self) -> None:
        for task in self._background:
            task.cancel()

    async def layer(
        self, layer: int, tokens: dict[str, bytes], counts: dict[str, int] | None = None
    ) -> dict[str, bytes]:
        """Every token's output of `layer` (`tokens`: id -> the activation it enters the layer with; `counts`: how
        many tokens an entry stands for, a prefill chunk's, 1 where not given)."""
        counts = counts or {}
        chosen = {tid: gate(self.model, layer, activation) for tid, activation in tokens.items()}
        answers: dict[str, dict[int, bytes]] = {tid: {} for tid in tokens}
        pending = {(tid, expert) for tid, picks in chosen.items() for expert, _ in picks}
        if self.static:
            return await self._static_layer(layer, tokens, counts, chosen)
        replay = False
        misses: dict[str, int] = {}  # EW -> answers it missed in this layer while its probe said it lives
        while pending:
            by_ew: dict[str, list[tuple[str, int]]] = {}
            for tid, expert in sorted(pending):
                ew = self.ert.resolve(expert, self.down)
                if ew is None:
                    raise NoLocation(expert, self.ert.experts[expert].ews())
                by_ew.setdefault(ew, []).append((tid, expert))
            results = await asyncio.gather(
                *(
                    self._watched(ew, self._send(ew, layer, items, tokens, counts, replay))
                    for ew, items in by_ew.items()
                )
            )
            for (ew, items), outputs in zip(by_ew.items(), results):
                if outputs == SILENT or outputs == DEAD:  # found by the data path's probes while it waited
                    self._take_down(ew, layer, len(items), silent=outputs == SILENT)
                    continue
                if isinstance(outputs, str):  # WRONG or REFUSED
                    # Answers of the wrong shape or for another layer: refused and counted, never merged; the EW is
                    # not trusted by this AW again until the control plane's next table gives it anew. So is one that
                    # refused the tokens the table sends it.
                    self.down.add(ew)
                    self.failovers.append({"at": time.monotonic(), "ew": ew, "layer": layer, outputs: True})
                    continue
                if outputs is None:
                    misses[ew] = misses.get(ew, 0) + 1
                    # A slow EW that answers its probe is tried again, up to MAX_MISSES in one layer (alive but not
                    # answering is as good as down); a down one is replayed elsewhere at once.
                    if misses[ew] >= MAX_MISSES or not await self._alive(ew):
                        self._take_down(ew, layer, len(items))
                    continue
                for tid, expert, output in outputs:
                    if output != expert_output(self.model, layer, expert, tokens[tid]):
                        self.mismatches[ew] = self.mismatches.get(ew, 0) + 1
                    answers[tid][expert] = output
                    pending.discard((tid, expert))
            replay = True
        return {tid: combine(self.model, layer, answers[tid], chosen[tid]) for tid in tokens}

    async def _static_layer(self, layer, tokens, counts, chosen) -> dict[str, bytes]:
        if not self._binding:
            self._binding = {e: where.primaries[0] for e, where in enumerate(self.ert.experts)}
        by_ew: dict[str, list[tuple[str, int]]] = {}
        for tid, picks in sorted(chosen.items()):
            for expert, _ in picks:
                by_ew.setdefault(self._binding[expert], []).append((tid, expert))
        results = await asyncio.gather(
            *(self._send(ew, layer, items, tokens, counts, False) for ew, items in by_ew.items())
        )
        answers: dict[str, dict[int, bytes]] = {tid: {} for tid in tokens}
        for ew, outputs in zip(by_ew, results):
            if outputs is None or isinstance(outputs, str):
                raise MoeError("ert", f"{ew} did not answer layer {layer}: a static binding has nowhere else to go")
            for tid, expert, output in outputs:
                answers[tid][expert] = output
        return {tid: combine(self.model, layer, answers[tid], chosen[tid]) for tid in tokens}

    def _take_down(self, ew: str, layer: int, tokens: int, silent: bool = False) -> None:
        self.down.add(ew)
        self.failovers.append({"at": time.monotonic(), "ew": ew, "layer": layer, "tokens": tokens, "silent": silent})
        if silent and ew not in self.silent:
            self.silent.add(ew)
            task = asyncio.ensure_future(self._readmit(ew))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _watched(self, ew: str, send):
        """`send`'s result, probing `ew` every `probe_every_s` while it runs: DEAD when a probe's connection is
        refused or breaks, SILENT after `probe_misses` probes in a row go unanswered (`send` is then cancelled)."""
        task = asyncio.ensure_future(send)
        probe, misses = None, 0
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.probe_every_s)
                if done:
                    return task.result()
                if probe is not None:
                    if not probe.done():
                        misses += 1
                    elif probe.result() is False:
                        return DEAD
                    else:
                        misses = 0
                if misses >= self.probe_misses:
                    return SILENT
                if probe is None or probe.done():
                    probe = asyncio.ensure_future(self._ping(ew))
        finally:
            for pending in (task, probe):
                if pending is not None and not pending.done():
                    pending.cancel()

    async def _ping(self, ew: str) -> bool:
        """True when the EW answers /health; False when its connection is refused or breaks (a dead process)."""
        try:
            async with self.session.get(self.addresses[ew] + "/health") as response:
                return response.status == 200
        except (aiohttp.ClientConnectionError, OSError):
            return False

    async def _readmit(self, ew: str) -> None:
        """Probe an EW taken as down for its silence until it answers (used again) or the table gives it anew."""
        while ew in self.silent and not self.session.closed:
            await asyncio.sleep(self.readmit_every_s)
            if ew in self.silent and await self._alive(ew):
                self.silent.discard(ew)
                self.down.discard(ew)
                self.readmitted += 1
                self.back.set()
                log.info("%s answers its probes again: used again", ew)

    async def recheck(self, expert: int) -> bool:
        """While `expert` has no live location for this AW: ask each EW the table names for it and this AW took
        as down whether it serves it again (a quick restart at its address, holding what it held, leaves the
        table as it was); True when one does, and it is used again."""
        back = False
        for ew in self.ert.experts[expert].ews():
            if ew not in self.down:
                continue
            try:
                async with self.session.get(
                    self.addresses[ew] + "/moe/status", timeout=aiohttp.ClientTimeout(total=4 * self.probe_timeout_s)
                ) as response:
                    status = await response.json(content_type=None) if response.status == 200 else {}
            except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
                continue
            held = set(status.get("primaries", [])) | set(status.get("shadows", []))
            if status.get("state") == "serving" and expert in held:
                self.down.discard(ew)
                self.silent.discard(ew)
                self.readmitted += 1
                self.back.set()
                log.info("%s serves expert %d again: used again", ew, expert)
                back = True
        return back

    async def _send(self, ew, layer, items, tokens, counts, replay) -> list[tuple[str, int, bytes]] | str | None:
        body = {
            "layer": layer,
            "replay": replay,
            "tokens": [
                {"id": tid, "expert": expert, "activation": tokens[tid].hex(), "count": counts.get(tid, 1)}
                for tid, expert in items
            ],
        }
        try:
            async with self.session.post(
                self.addresses[ew] + "/moe/layer", json=body, timeout=aiohttp.ClientTimeout(total=self.answer_timeout_s)
            ) as response:
                answer = await response.json(content_type=None)
                if response.status == 400:
                    # The EW does not hold what the table says (it restarted with another holding, say): counted and
                    # logged, and it is not used by this AW until the control plane's next table gives it anew; the
                    # tokens go to another location, or wait for one.
                    self.refusals[ew] = self.refusals.get(ew, 0) + 1
                    log.warning("%s refused layer %d: %s", ew, layer, (answer.get("error") or {}).get("message"))
                    return REFUSED
                if response.status != 200:
                    return None
        except (TimeoutError, aiohttp.ClientError, OSError):
            return None
        carried = sum(counts.get(tid, 1) for tid, _ in items)
        self.sent[ew] = self.sent.get(ew, 0) + carried
        self.link_bytes += 2 * carried * activation_bytes(self.model)
        try:
            outputs = [(o["id"], o["expert"], bytes.fromhex(o["output"])) for o in answer["outputs"]]
            right = answer.get("layer") == layer and sorted((t, e) for t, e, _ in outputs) == sorted(items)
            right = right and all(len(output) == OUTPUT_BYTES for _, _, output in outputs)
        except (KeyError, TypeError, ValueError, AttributeError):
            right = False
        if not right:
            self.wrong_answers += 1
            log.warning("%s answered layer %d with the wrong shape or for another layer: refused", ew, layer)
            return WRONG
        return outputs

    async def _alive(self, ew: str) -> bool:
        try:
            async with self.session.get(
                self.addresses[ew] + "/health", timeout=aiohttp.ClientTimeout(total=self.probe_timeout_s)
            ) as response:
                return response.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False


class ExpertPath:
    """An MoE attention worker's expert layers, run for each engine step (workers.engine): every layer of the
    step's tokens through the EWs (answers that differ from the experts' pure functions counted, `Refe.mismatches`),
    and an expert with no live location waited out until the control plane sends a table that has one (`update`)."""

    def __init__(
        self,
        model: Model,
        ert: ExpertRoutingTable,
        addresses: dict[str, str],
        wait_s: float = 30.0,
        counters: dict | None = None,
        static: bool = False,
    ):
        self.model, self._first, self.addresses, self.wait_s = model, ert, dict(addresses), wait_s
        self.static = static
        self.refe: Refe | None = None
        self.session: aiohttp.ClientSession | None = None
        self.changed = asyncio.Event()
        self.recheck_every_s = 0.5  # while an expert has no live location: how often its holders are asked again
        self.counters = counters if counters is not None else {}  # the engine's, so the node's status shows them
        self.counters.update(
            moe_layers=0,
            moe_mismatches=0,
            moe_waits=0,
            moe_failovers=0,
            moe_failovers_silent=0,  # of them, EWs taken as down for missed probes only (a loaded host's live EW)
            moe_readmitted=0,
            moe_refusals=0,
            moe_ert_version=ert.version,
        )

    @property
    def ert(self) -> ExpertRoutingTable:
        """The table in force: the datapath's, once started."""
        return self.refe.ert if self.refe is not None else self._first

    async def start(self) -> None:
        self.session = aiohttp.ClientSession()
        self.refe = Refe(self.model, self._first, self.addresses, self.session, static=self.static)

    async def aclose(self) -> None:
        if self.refe is not None:
            self.refe.close()
        if self.session is not None:
            await self.session.close()

    def update(self, ert: ExpertRoutingTable, addresses: dict[str, str] | None = None) -> bool:
        if self.refe is None or not self.refe.update(ert, addresses):
            return False
        self.counters["moe_ert_version"] = ert.version
        self.changed.set()
        return True

    async def step(self, entries: dict[str, tuple[bytes, int]]) -> None:
        """Every layer for the step's sequences (`entries`: request id -> (context state, tokens computed))."""
        assert self.refe is not None, "start() first"
        tokens = {tid: state for tid, (state, _) in entries.items()}
        counts = {tid: count for tid, (_, count) in entries.items()}
        for layer in range(self.model.layers):
            tokens = await self._layer(layer, tokens, counts)
            self.counters["moe_layers"] += 1
        self.counters["moe_failovers"] = len(self.refe.failovers)
        self.counters["moe_failovers_silent"] = sum(bool(f.get("silent")) for f in self.refe.failovers)
        self.counters["moe_mismatches"] = sum(self.refe.mismatches.values())
        self.counters["moe_refusals"] = sum(self.refe.refusals.values())
        self.counters["moe_readmitted"] = self.refe.readmitted

    async def _layer(self, layer, tokens, counts) -> dict[str, bytes]:
        assert self.refe is not None, "start() first"
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                return await self.refe.layer(layer, tokens, counts)
            except NoLocation as exc:
                if time.monotonic() > deadline:
                    raise
                self.counters["moe_waits"] += 1
                # Cleared before the recheck, so that an EW used again meanwhile is not missed: a new table, or an
                # EW taken as down for its silence answering again (a loaded host's live EW: tenths of a second),
                # ends the wait at once rather than at the next recheck.
                self.changed.clear()
                self.refe.back.clear()
                if await self.refe.recheck(exc.expert):
                    continue
                waits = {asyncio.ensure_future(self.changed.wait()), asyncio.ensure_future(self.refe.back.wait())}
                first = asyncio.FIRST_COMPLETED
                _, waiting = await asyncio.wait(waits, timeout=self.recheck_every_s, return_when=first)
                for wait in waiting:
                    wait.cancel()
