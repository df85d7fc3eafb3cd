"""Expert workers as real processes and the AW's datapath to them (document 001, TARRAGON §5.1): an EW killed with
SIGKILL in the middle of decoding is found by the AW's probe, the tokens it held are replayed on the experts'
shadows, and every layer's output is what an undisturbed run gives, with a bounded stall; an EW refuses tokens
for experts it does not hold; an expert with no live location is named, and a replacement's table resumes it."""

import asyncio
import json
import signal
import subprocess
import sys
import time

import aiohttp
import pytest

from recovery.policy import moe as moe_policy
from tests.helpers import BASE_DIR, http_json
from workers import catalog
from workers.moe import ExpertRoutingTable, combine, expert_bytes, expert_output, gate
from workers.refe import ExpertPath, NoLocation, Refe

MIXTRAL = catalog.MODELS["Mixtral-8x7B"]
LAYERS = MIXTRAL.layers


class Ew:
    def __init__(self, name: str, experts, shadows, *extra: str):
        argv = [sys.executable, "-m", "workers.expert_worker", "--name", name, "--model", MIXTRAL.key]
        argv += ["--experts", ",".join(map(str, experts)), "--shadows", ",".join(map(str, shadows)), *extra]
        self.proc = subprocess.Popen(argv, cwd=BASE_DIR, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline()
        assert line, f"{name} did not start (exit code {self.proc.poll()})"
        self.address = json.loads(line)["address"]

    def kill(self, signum=signal.SIGKILL):
        self.proc.send_signal(signum)
        if signum == signal.SIGKILL:
            self.proc.wait(5)


@pytest.fixture
def deployment():
    """Three EWs of Mixtral-8x7B on H100s, each expert with a primary and a shadow (the control plane's plan)."""
    room = moe_policy.ExpertWorker  # six experts' room each: 8 primaries and 8 shadows fit in 18 slots
    table = moe_policy.plan(MIXTRAL, [room(f"ew-{i}", expert_bytes(MIXTRAL) * 6) for i in range(3)])
    workers = {
        ew: Ew(ew, table.primaries_of(ew), table.shadows_of(ew), "--time-scale", "1") for ew in sorted(table.ews())
    }
    yield table, workers
    for worker in workers.values():
        if worker.proc.poll() is None:
            worker.proc.send_signal(signal.SIGCONT)  # one the test froze
            worker.proc.terminate()
            worker.proc.wait(10)


def reference(tokens: dict[str, bytes], steps: int) -> dict[str, bytes]:
    """What the layers give without any EW: the same pure functions, computed here."""
    for _ in range(steps):
        for layer in range(LAYERS):
            tokens = {
                tid: combine(MIXTRAL, layer, {e: expert_output(MIXTRAL, layer, e, act) for e, _ in picks}, picks)
                for tid, act in tokens.items()
                for picks in [gate(MIXTRAL, layer, act)]
            }
    return tokens


async def decode(refe: Refe, tokens: dict[str, bytes], steps: int, on_layer=None) -> tuple[dict[str, bytes], float]:
    """`steps` decode steps of every layer through the EWs; returns the outputs and the longest gap between two
    layers completing (the stall an AW's requests see)."""
    longest, last, done = 0.0, time.monotonic(), 0
    for _ in range(steps):
        for layer in range(LAYERS):
            tokens = await _layer_as_the_aw_does(refe, layer, tokens)
            now = time.monotonic()
            longest, last, done = max(longest, now - last), now, done + 1
            if on_layer:
                on_layer(done)
    return tokens, longest


async def _layer_as_the_aw_does(refe: Refe, layer: int, tokens: dict[str, bytes], wait_s: float = 5.0):
    """One layer, as the attention worker runs it (workers/refe.py, ExpertPath._layer): where an expert has no live
    location because the EWs holding it were taken as down for their silence alone (live ones on a loaded host that
    missed their 10 ms probes), they are asked again, and the layer waits for one to be used again (its background
    probe) rather than losing the expert. Raising on the first failed ask, as this helper once did, failed a suite
    run beside other work: the ask itself timed out (0.2 s) while the EW lived ("expert 7 has no live location")."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return await refe.layer(layer, tokens)
        except NoLocation as exc:
            if time.monotonic() > deadline or not (set(refe.ert.experts[exc.expert].ews()) & refe.silent):
                raise  # lost for good: no holder of it is only silent
            refe.back.clear()
            if not await refe.recheck(exc.expert):
                try:
                    await asyncio.wait_for(refe.back.wait(), max(deadline - time.monotonic(), 0.01))
                except TimeoutError:
                    pass


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
async def test_an_ew_killed_mid_decode_is_replayed_on_shadows_with_identical_output_and_a_short_stall(
    deployment, signum
):
    """Killed, its connections fail at once; hung (SIGSTOP), the data path's 10 ms probes go unanswered."""
    table, workers = deployment
    start = {f"req-{i}": f"prompt of request {i}".encode() for i in range(6)}
    expected = reference(start, steps=4)
    victim = max(workers, key=lambda ew: len(table.primaries_of(ew)))

    killed_at = []

    def kill_at(done):
        if done == 50:  # in the second decode step
            killed_at.append(time.monotonic())
            workers[victim].kill(signum)

    async with aiohttp.ClientSession() as session:
        addresses = {ew: w.address for ew, w in workers.items()}
        refe = Refe(MIXTRAL, table, addresses, session)
        outputs, longest = await decode(refe, dict(start), 4, kill_at)
    assert outputs == expected  # no layer lost, none computed differently
    # The victim taken down once it was killed, and only it; a live EW that missed its probes on a loaded host (the
    # victim too, before its kill) costs a replay, counted apart (silent) and used again (a run on 2026-12-06 took
    # ew-0 down so, and lost the expert without a recheck; a loaded run on 2026-12-07 had the victim silent once
    # before its SIGSTOP, and another EW's shadows serve while that EW is out).
    after = [f for f in refe.failovers if f["at"] >= killed_at[0]]
    assert refe.down == {victim} and [f["ew"] for f in after].count(victim) == 1, refe.failovers
    assert all(f.get("silent") for f in refe.failovers if f not in after or f["ew"] != victim), refe.failovers
    assert longest < 0.5, f"stall {longest:.3f} s"
    # The shadows of the victim's experts served them, and no other shadow was woken but those of an EW taken as
    # down for its silence.
    out = {victim} | {f["ew"] for f in refe.failovers if f.get("silent")}
    served_by_shadow = set()
    for ew, worker in workers.items():
        if ew != victim:
            status = http_json(worker.address + "/moe/status")[1]
            served_by_shadow |= {int(e) for e in status["tokens_per_expert"]} & set(status["shadows"])
    assert served_by_shadow & set(table.primaries_of(victim))
    assert served_by_shadow <= {e for ew in out for e in table.primaries_of(ew)}, (served_by_shadow, refe.failovers)


async def test_a_hung_ew_is_found_by_the_data_paths_10_ms_probes_not_its_answer_timeout_and_used_again_once_it_answers(
    deployment,
):
    """TARRAGON's failure probing on the data path: with a 10 s answer timeout, only the probes sent every 10 ms
    while the AW waits can find a hung EW (SIGSTOP: its kernel still accepts connections) within the stall bound.
    Taken as down only for its silence, it is probed in the background and used again, without a new table, once
    it answers (SIGCONT): a live EW on a loaded host that misses a few probes costs a replay, not its place."""
    table, workers = deployment
    start = {f"req-{i}": f"prompt of request {i}".encode() for i in range(6)}
    victim = max(workers, key=lambda ew: len(table.primaries_of(ew)))

    def freeze_at(done):
        if done == 40:
            workers[victim].kill(signal.SIGSTOP)

    async with aiohttp.ClientSession() as session:
        addresses = {ew: w.address for ew, w in workers.items()}
        refe = Refe(MIXTRAL, table, addresses, session, answer_timeout_s=10.0)
        outputs, longest = await decode(refe, dict(start), 2, freeze_at)
        assert outputs == reference(start, steps=2)
        assert refe.down == {victim} == refe.silent
        assert [(f["ew"], f["silent"]) for f in refe.failovers] == [(victim, True)]
        assert longest < 0.5, f"stall {longest:.3f} s: the answer timeout (10 s) was waited, not the probes"

        workers[victim].kill(signal.SIGCONT)
        deadline = time.monotonic() + 5
        while victim in refe.down and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert victim not in refe.down and refe.readmitted == 1 and refe.ert.version == table.version
        before = refe.sent.get(victim, 0)
        outputs, _ = await decode(refe, outputs, 1)
        assert outputs == reference(start, steps=3)
        assert refe.sent[victim] > before  # its experts are served by it again
        refe.close()


async def test_a_static_binding_sends_each_expert_to_its_first_primary_and_takes_no_table(deployment):
    """The baseline benchmarks.moe_fleet measures the table against: the same outputs, every expert's tokens on its
    first primary (no shadow ever woken), and a newer table ignored."""
    table, workers = deployment
    start = {f"req-{i}": f"prompt of request {i}".encode() for i in range(4)}
    async with aiohttp.ClientSession() as session:
        refe = Refe(MIXTRAL, table, {ew: w.address for ew, w in workers.items()}, session, static=True)
        outputs, _ = await decode(refe, dict(start), 1)
        moved = ExpertRoutingTable(table.model, table.version + 1, tuple(reversed(table.experts)))
        assert not refe.update(moved) and refe.ert is table
    assert outputs == reference(start, steps=1)
    served = set()
    for ew, worker in workers.items():
        status = http_json(worker.address + "/moe/status")[1]
        assert {int(e) for e in status["tokens_per_expert"]} <= set(table.primaries_of(ew))  # no shadow woken
        served |= {int(e) for e in status["tokens_per_expert"]}
    assert served  # the EWs did the work


async def test_an_expert_with_no_live_location_is_named_and_a_replacement_table_resumes_it(deployment):
    table, workers = deployment
    expert = 0
    holders = table.experts[expert].ews()
    for ew in holders:
        workers[ew].kill()
    # The gate must pick expert 0 for some token at layer 0: find a context that does.
    context = next(f"ctx-{i}".encode() for i in range(1000) if expert in dict(gate(MIXTRAL, 0, f"ctx-{i}".encode())))
    async with aiohttp.ClientSession() as session:
        refe = Refe(MIXTRAL, table, {ew: w.address for ew, w in workers.items()}, session)
        with pytest.raises(NoLocation) as missing:
            await refe.layer(0, {"t": context})
        assert missing.value.expert == expert and set(holders) <= refe.down
        # The control plane provisions a replacement EW for what was lost and sends the new table.
        lost = [e for e, loc in enumerate(table.experts) if set(loc.ews()) <= set(holders)]
        replacement = Ew("ew-9", lost, [], "--time-scale", "1")
        try:
            new = moe_policy.with_replacement(table, lost, "ew-9")
            new = moe_policy.after_loss(new, [ew for ew in holders])
            assert refe.update(new, {"ew-9": replacement.address})
            out = await refe.layer(0, {"t": context})
        finally:
            replacement.proc.terminate()
            replacement.proc.wait(10)
    picks = gate(MIXTRAL, 0, context)
    assert out == {"t": combine(MIXTRAL, 0, {e: expert_output(MIXTRAL, 0, e, context) for e, _ in picks}, picks)}


async def test_a_step_waiting_for_an_expert_resumes_as_soon_as_a_silent_holder_answers_again(deployment):
    """On a loaded host live EWs miss their 10 ms probes and are taken as down for their silence; where every holder
    of an expert is so, the step waits for a location. One of them answering its probes again ends the wait at
    once: the step does not sleep out its recheck (a loaded run's stream paused a second so, issue 41). Here the
    holders' recheck fails (as its ask times out on such a host) and the recheck is a minute away: only the
    re-admission can end the wait."""
    table, workers = deployment
    expert = 0
    context = next(f"ctx-{i}".encode() for i in range(1000) if expert in dict(gate(MIXTRAL, 0, f"ctx-{i}".encode())))
    path = ExpertPath(MIXTRAL, table, {ew: w.address for ew, w in workers.items()})
    path.recheck_every_s = 60
    await path.start()
    try:

        async def unanswered(expert: int) -> bool:
            return False

        path.refe.recheck = unanswered
        for ew in table.experts[expert].ews():  # alive, but silent for a moment
            path.refe._take_down(ew, 0, 1, silent=True)
        await asyncio.wait_for(path.step({"t": (context, 1)}), 10)
    finally:
        await path.aclose()
    assert path.counters["moe_waits"] >= 1 and path.counters["moe_readmitted"] >= 1, path.counters
    assert path.counters["moe_layers"] == LAYERS and path.counters["moe_mismatches"] == 0, path.counters


def test_an_ew_refuses_tokens_for_experts_it_does_not_hold_and_bad_layers(deployment):
    table, workers = deployment
    ew = sorted(workers)[0]
    held = set(table.primaries_of(ew)) | set(table.shadows_of(ew))
    other = next(e for e in range(MIXTRAL.experts) if e not in held)
    url = workers[ew].address + "/moe/layer"
    status, body = http_json(url, data={"layer": 0, "tokens": [{"id": "t", "expert": other, "activation": "00"}]})
    assert (
        status == 400
        and body["error"]["param"] == "tokens[0].expert"
        and f"expert {other} is not held" in (body["error"]["message"])
    )
    status, body = http_json(url, data={"layer": 32, "tokens": [{"id": "t", "expert": min(held), "activation": ""}]})
    assert status == 400 and body["error"]["param"] == "layer"
    assert http_json(workers[ew].address + "/moe/status")[1]["refused"] == 2


async def test_an_ew_answering_for_another_layer_is_refused_counted_and_replayed_on_the_shadow():
    from aiohttp import web

    async def wrong_layer(request):
        body = await request.json()
        outputs = [
            {"id": t["id"], "expert": t["expert"], "output": expert_output(MIXTRAL, 0, t["expert"], b"x").hex()}
            for t in body["tokens"]
        ]
        return web.json_response({"layer": body["layer"] + 1, "outputs": outputs})

    bad = await fake_ew(wrong_layer)
    good = Ew("ew-good", [], range(MIXTRAL.experts), "--gpu", "H200-SXM")  # every expert, as shadows
    try:
        table = ExpertRoutingTable.parse(
            {
                "model": MIXTRAL.key,
                "version": 1,
                "experts": [{"primaries": ["ew-bad"], "shadows": ["ew-good"]}] * MIXTRAL.experts,
            },
            MIXTRAL,
        )
        start = {"t": b"a token"}
        async with aiohttp.ClientSession() as session:
            refe = Refe(MIXTRAL, table, {"ew-bad": f"http://127.0.0.1:{bad.port}", "ew-good": good.address}, session)
            out = await refe.layer(0, start)
            again = await refe.layer(1, out)
        assert out == one_layer(0, start)
        assert refe.wrong_answers == 1 and refe.down == {"ew-bad"}
        assert refe.failovers[0]["wrong_answer"] and again == one_layer(1, out)
    finally:
        await bad.close()
        good.proc.terminate()
        good.proc.wait(10)


def one_layer(layer: int, tokens: dict[str, bytes]) -> dict[str, bytes]:
    return {
        tid: combine(MIXTRAL, layer, {e: expert_output(MIXTRAL, layer, e, act) for e, _ in picks}, picks)
        for tid, act in tokens.items()
        for picks in [gate(MIXTRAL, layer, act)]
    }


async def test_an_ew_that_answers_its_probe_but_never_its_layer_is_taken_as_down_after_three_misses():
    from aiohttp import web

    async def broken(request):
        return web.json_response({"error": {"message": "internal error", "param": None}}, status=500)

    bad = await fake_ew(broken)
    good = Ew("ew-good", [], range(MIXTRAL.experts), "--gpu", "H200-SXM")
    try:
        rows = [{"primaries": ["ew-bad"], "shadows": ["ew-good"]}] * MIXTRAL.experts
        table = ExpertRoutingTable.parse({"model": MIXTRAL.key, "version": 1, "experts": rows}, MIXTRAL)
        start = {"t": b"another token"}
        async with aiohttp.ClientSession() as session:
            refe = Refe(MIXTRAL, table, {"ew-bad": f"http://127.0.0.1:{bad.port}", "ew-good": good.address}, session)
            out = await refe.layer(0, start)
        assert out == one_layer(0, start) and refe.down == {"ew-bad"} and len(refe.failovers) == 1
    finally:
        await bad.close()
        good.proc.terminate()
        good.proc.wait(10)


async def test_answers_that_differ_from_the_experts_function_are_counted_against_their_ew():
    """Silent corruption on an EW: well formed, for the right layer, but not the expert's output. An AW cannot tell
    and merges it; the emulator's ground truth counts it, per EW (the canaries are what find such an EW)."""
    from aiohttp import web

    async def corrupt(request):
        body = await request.json()
        outputs = [
            {"id": t["id"], "expert": t["expert"], "output": expert_output(MIXTRAL, 0, t["expert"], b"drift").hex()}
            for t in body["tokens"]
        ]
        return web.json_response({"layer": body["layer"], "outputs": outputs})

    bad = await fake_ew(corrupt)
    try:
        rows = [{"primaries": ["ew-sdc"], "shadows": []}] * MIXTRAL.experts
        table = ExpertRoutingTable.parse({"model": MIXTRAL.key, "version": 1, "experts": rows}, MIXTRAL)
        start = {"t": b"a third token"}
        async with aiohttp.ClientSession() as session:
            refe = Refe(MIXTRAL, table, {"ew-sdc": f"http://127.0.0.1:{bad.port}"}, session)
            out = await refe.layer(0, start)
        assert out != one_layer(0, start) and refe.mismatches == {"ew-sdc": MIXTRAL.experts_per_token}
        assert not refe.down and refe.wrong_answers == 0
    finally:
        await bad.close()


async def fake_ew(answer_layer):
    """An EW of the test's own (a real HTTP server in this loop) that answers its probe and, for a layer,
    whatever `answer_layer(request)` does."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    async def health(request):
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/moe/layer", answer_layer)
    app.router.add_get("/health", health)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


async def test_an_ew_that_refuses_what_the_table_sends_it_is_failed_over_not_fatal():
    """An EW restarted with another holding than the table says (a standby's first command line): its 400 is counted,
    the AW stops using it, and the tokens are served by the expert's other location, the output unchanged."""
    empty = Ew("ew-empty", [], [])
    good = Ew("ew-good", [], range(MIXTRAL.experts), "--gpu", "H200-SXM")
    try:
        table = ExpertRoutingTable.parse(
            {
                "model": MIXTRAL.key,
                "version": 1,
                "experts": [{"primaries": ["ew-empty"], "shadows": ["ew-good"]}] * MIXTRAL.experts,
            },
            MIXTRAL,
        )
        start = {"t": b"a token"}
        async with aiohttp.ClientSession() as session:
            refe = Refe(MIXTRAL, table, {"ew-empty": empty.address, "ew-good": good.address}, session)
            out = await refe.layer(0, start)
        assert out == one_layer(0, start)
        assert refe.refusals == {"ew-empty": 1} and refe.down == {"ew-empty"} and refe.failovers[0]["refused"]
    finally:
        for worker in (empty, good):
            worker.proc.terminate()
            worker.proc.wait(10)
