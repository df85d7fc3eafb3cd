"""Status events to each subscriber (the agent's `/agent/events` streams), for every engine.

A slow subscriber never blocks the engine: when its queue is full its oldest
status is dropped. A dropped status may be the one arrival event a gateway
settles its dispatch ledger on (document 002), so the next status that
subscriber gets after a loss is a full one: it names every request the node
has in flight (`requests`) and those it finished lately (`finished`), and the
gateway reconciles its ledger from it. A new subscriber's first queued status
is a full one too: what happened before it subscribed, it never saw.
"""

import asyncio
from collections import deque
from collections.abc import Iterable

QUEUE_SIZE = 256  # statuses a subscriber may fall behind by before its oldest are dropped
# Finished request ids a full status names. A request whose arrival was dropped and whose end is still queued is
# settled by its end; one whose end was dropped too ended before every status still queued, so fewer than a queue's
# worth of requests ended after it: twice that is ample.
FINISHED_KEPT = 2 * QUEUE_SIZE


class StatusFeed:
    def __init__(self, queue_size: int = QUEUE_SIZE):
        self.queue_size = queue_size
        self._subscribers: dict[asyncio.Queue, bool] = {}  # queue -> owed a full status (it lost some, or is new)
        self._finished: deque[str] = deque(maxlen=FINISHED_KEPT)
        self.dropped = 0  # statuses dropped for slow subscribers, all told

    def __bool__(self) -> bool:
        return bool(self._subscribers)

    def subscribe(self) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue(maxsize=self.queue_size)
        self._subscribers[queue] = True
        return queue

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        self._subscribers.pop(queue, None)

    def finished(self, request_id: str) -> None:
        """`request_id` ended on this node: a full status names it for a while."""
        self._finished.append(request_id)

    def publish(self, status: dict, in_flight: Iterable[str]) -> None:
        """Queue `status` for every subscriber; one owed a full status gets it with the request ids."""
        full = None
        for queue, owed in list(self._subscribers.items()):
            if queue.full():  # a slow subscriber loses old statuses, never blocks the engine
                try:
                    queue.get_nowait()
                except asyncio.QueueEmpty:
                    pass
                self.dropped += 1
                owed = True
            if owed:
                if full is None:
                    full = {**status, "requests": sorted(in_flight), "finished": list(self._finished)}
                queue.put_nowait(full)
                self._subscribers[queue] = False
            else:
                queue.put_nowait(status)
