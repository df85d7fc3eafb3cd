"""The `partition` fault: a node cut off from its control plane for a while (workers.faults), and its link
(workers.control.ControlPlaneLink) sending nothing while it lasts and registering and beating again once healed."""

import asyncio
import logging

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from workers import protocol
from workers.control import ControlPlaneLink
from workers.faults import KINDS, FaultError, FaultState


# --- The fault ----------------------------------------------------------------------------------------------------
def test_a_partition_lasts_its_seconds_then_heals():
    faults = FaultState(enabled=True)
    fault = faults.inject("partition", {"seconds": 5}, now=1000.0)
    assert "partition" in KINDS and fault.params == {"seconds": 5.0}
    assert faults.partitioned(1000.0) and faults.partitioned(1004.99)
    assert not faults.partitioned(1005.0)  # healed
    assert "partition" not in faults.active
    assert not faults.partitioned(1001.0)  # healed for good, not a window that comes back


def test_a_partition_lasts_thirty_seconds_unless_told():
    faults = FaultState(enabled=True)
    faults.inject("partition", {}, now=0.0)
    assert faults.partitioned(29.9) and not faults.partitioned(30.0)
    assert not FaultState(enabled=True).partitioned(0.0)  # no fault, no partition


@pytest.mark.parametrize("seconds", [0, -1, 86401, "ten", True])
def test_a_partition_of_a_bad_length_is_refused_naming_seconds(seconds):
    with pytest.raises(FaultError) as refused:
        FaultState(enabled=True).inject("partition", {"seconds": seconds}, now=0.0)
    assert refused.value.field == "seconds"


def test_clearing_a_partition_ends_it():
    faults = FaultState(enabled=True)
    faults.inject("partition", {"seconds": 60}, now=0.0)
    faults.clear("partition")
    assert not faults.partitioned(1.0)


# --- The link --------------------------------------------------------------------------------------------------------
class Plane:
    """A control plane that answers registrations and heartbeats and counts them."""

    def __init__(self):
        self.registrations = 0
        self.heartbeats = 0
        self.changed = asyncio.Condition()
        app = web.Application()
        app.router.add_post(protocol.REGISTER_PATH, self.register)
        app.router.add_post(protocol.HEARTBEAT_PATH.format(name="{name}"), self.heartbeat)
        self.server = TestServer(app, host="127.0.0.1")

    async def register(self, request):
        protocol.Registration.parse(await request.json())
        await self._count("registrations")
        return web.json_response({"state": "join", "heartbeat_interval_s": 0.01})

    async def heartbeat(self, request):
        protocol.Heartbeat.parse(await request.json())
        await self._count("heartbeats")
        return web.json_response({"state": "serving"})

    async def _count(self, what: str):
        async with self.changed:
            setattr(self, what, getattr(self, what) + 1)
            self.changed.notify_all()

    async def wait_for(self, predicate, timeout_s: float = 10.0):
        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(predicate), timeout_s)


REGISTRATION = protocol.Registration.parse(
    {
        "name": "node-p",
        "session": "0123456789abcdef0123456789abcdef",
        "address": "http://127.0.0.1:9100",
        "rack": "rack-a",
        "model": "Qwen3-32B",
        "gpu": "H100-SXM",
        "tp": 1,
        "pid": 7,
        "host": "h",
        "gpus": [{"index": 0, "uuid": "GPU-node-p", "name": "H100", "memory_bytes": 80 * 10**9}],
    }
)


class Clock:
    """The fault's clock, moved by the test; it counts the link's checks and says when one saw a partition."""

    def __init__(self, faults: FaultState, now: float):
        self.faults, self.now = faults, now
        self.checks_partitioned = 0
        self.seen_partitioned = asyncio.Event()

    def partitioned(self) -> bool:
        cut = self.faults.partitioned(self.now)
        if cut:
            self.checks_partitioned += 1
            if self.checks_partitioned >= 3:
                self.seen_partitioned.set()
        return cut


async def heartbeat() -> protocol.Heartbeat:
    return protocol.Heartbeat(session=REGISTRATION.session)


@pytest.fixture
async def plane():
    plane = Plane()
    await plane.server.start_server()
    yield plane
    await plane.server.close()


async def run_link(plane: Plane, clock: Clock) -> tuple[ControlPlaneLink, asyncio.Task]:
    link = ControlPlaneLink(
        str(plane.server.make_url("")),
        "node-token",
        lambda: REGISTRATION,
        heartbeat,
        interval_s=0.01,
        partitioned=clock.partitioned,
    )
    return link, asyncio.create_task(link.run())


async def stop(task: asyncio.Task) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_partitioned_node_neither_registers_nor_beats_until_it_heals(plane, caplog):
    caplog.set_level(logging.WARNING, logger="workers.control")
    faults = FaultState(enabled=True)
    faults.inject("partition", {"seconds": 30}, now=1000.0)
    clock = Clock(faults, now=1000.0)
    link, task = await run_link(plane, clock)
    try:
        await asyncio.wait_for(clock.seen_partitioned.wait(), 10)  # three rounds of the link, each cut off
        assert (plane.registrations, plane.heartbeats) == (0, 0)
        assert not link.registered and "network partition" in link.last_error
        assert len([r for r in caplog.records if "network partition" in r.getMessage()]) == 1  # said once

        clock.now = 1030.0  # healed
        await plane.wait_for(lambda: plane.heartbeats >= 2)
        assert plane.registrations == 1 and link.registered and link.last_error is None
        assert "partition" not in faults.active
    finally:
        await stop(task)


async def test_a_partition_of_a_registered_node_stops_its_heartbeats_then_they_resume(plane):
    faults = FaultState(enabled=True)
    clock = Clock(faults, now=1000.0)
    link, task = await run_link(plane, clock)
    try:
        await plane.wait_for(lambda: plane.heartbeats >= 2)
        faults.inject("partition", {"seconds": 5}, now=1000.0)
        await asyncio.wait_for(clock.seen_partitioned.wait(), 10)
        # Each round checks the partition before it sends anything, and a beat is answered before the next round:
        # what the plane has counted now is all it gets while the partition lasts.
        during = plane.heartbeats
        clock.seen_partitioned.clear()
        clock.checks_partitioned = 0
        await asyncio.wait_for(clock.seen_partitioned.wait(), 10)  # three more rounds, cut off
        assert plane.heartbeats == during and plane.registrations == 1

        clock.now = 1005.0  # healed: the same session beats again, no new registration needed
        await plane.wait_for(lambda: plane.heartbeats >= during + 2)
        assert plane.registrations == 1 and link.last_error is None
    finally:
        await stop(task)
