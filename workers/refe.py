"""The attention worker's side of the MoE datapath (document 001's REFE, §4.1 and §5.1): at each layer, each
token's selected experts are resolved through the AW's copy of the expert routing table and its activation sent
to the EWs that hold them; the layer completes when every selected expert has answered.

An EW that does not answer within `answer_timeout_s` (or whose connection breaks) is probed with a short
`probe_timeout_s`; one that does not answer the probe is taken as down for this AW, and the tokens it held are
replayed at once on the next location of each expert (a live primary, else a shadow), marked as a replay so the
EW runs them first. An expert with no live location left raises `NoLocation`, naming it: the AW waits for the
control plane's next table (`update`) rather than skip the expert. Answers are pure functions of their inputs
(`workers.moe`), so a replayed layer gives the same output as the first try would have.
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
    down: set[str] = field(default_factory=set)
    failovers: list[dict] = field(default_factory=list)  # one per EW found down: when, which, what was replayed
    sent: dict[str, int] = field(default_factory=dict)  # tokens per EW
    link_bytes: int = 0  # activations out and expert outputs back, accounted in full (DESIGN.md contract 3)
    wrong_answers: int = 0  # answers refused: the wrong shape, or for another layer
    # The emulator's ground truth, per EW: answers that differ from the expert's pure function (silent corruption).
    # A real AW cannot tell and merges them as this one does; the canaries are what find such an EW.
    mismatches: dict[str, int] = field(default_factory=dict)
    refusals: dict[str, int] = field(default_factory=dict)  # dispatches an EW refused (400), per EW

    def update(self, ert: ExpertRoutingTable, addresses: dict[str, str] | None = None) -> bool:
        """Take the control plane's newer table (an older or equal version is ignored)."""
        if ert.model != self.ert.model or ert.version <= self.ert.version:
            return False
        self.ert = ert
        self.addresses.update(addresses or {})
        self.down -= set(addresses or {})  # an EW given anew (a replacement at an address) is tried again
        return True

    async def layer(
        self, layer: int, tokens: dict[str, bytes], counts: dict[str, int] | None = None
    ) -> dict[str, bytes]:
        """Every token's output of `layer` (`tokens`: id -> the activation it enters the layer with; `counts`: how
        many tokens an entry stands for, a prefill chunk's, 1 where not given)."""
        counts = counts or {}
        chosen = {tid: gate(self.model, layer, activation) for tid, activation in tokens.items()}
        answers: dict[str, dict[int, bytes]] = {tid: {} for tid in tokens}
        pending = {(tid, expert) for tid, picks in chosen.items() for expert, _ in picks}
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
                *(self._send(ew, layer, items, tokens, counts, replay) for ew, items in by_ew.items())
            )
            for (ew, items), outputs in zip(by_ew.items(), results):
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
                        self.down.add(ew)
                        self.failovers.append({"at": time.monotonic(), "ew": ew, "layer": layer, "tokens": len(items)})
                    continue
                for tid, expert, output in outputs:
                    if output != expert_output(self.model, layer, expert, tokens[tid]):
                        self.mismatches[ew] = self.mismatches.get(ew, 0) + 1
                    answers[tid][expert] = output
                    pending.discard((tid, expert))
            replay = True
        return {tid: combine(self.model, layer, answers[tid], chosen[tid]) for tid in tokens}

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
    ):
        self.model, self._first, self.addresses, self.wait_s = model, ert, dict(addresses), wait_s
        self.refe: Refe | None = None
        self.session: aiohttp.ClientSession | None = None
        self.changed = asyncio.Event()
        self.counters = counters if counters is not None else {}  # the engine's, so the node's status shows them
        self.counters.update(
            moe_layers=0, moe_mismatches=0, moe_waits=0, moe_failovers=0, moe_refusals=0, moe_ert_version=ert.version
        )

    @property
    def ert(self) -> ExpertRoutingTable:
        """The table in force: the datapath's, once started."""
        return self.refe.ert if self.refe is not None else self._first

    async def start(self) -> None:
        self.session = aiohttp.ClientSession()
        self.refe = Refe(self.model, self._first, self.addresses, self.session)

    async def aclose(self) -> None:
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
        self.counters["moe_mismatches"] = sum(self.refe.mismatches.values())
        self.counters["moe_refusals"] = sum(self.refe.refusals.values())

    async def _layer(self, layer, tokens, counts) -> dict[str, bytes]:
        assert self.refe is not None, "start() first"
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                return await self.refe.layer(layer, tokens, counts)
            except NoLocation:
                if time.monotonic() > deadline:
                    raise
                self.counters["moe_waits"] += 1
                self.changed.clear()
                try:
                    await asyncio.wait_for(self.changed.wait(), timeout=0.5)
                except TimeoutError:
                    pass
