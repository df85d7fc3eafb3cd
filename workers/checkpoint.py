"""The serving side of KV checkpointing: stream completed blocks to holders.

The engine only notes that a block is complete (a list append); a sender task
per holder batches the pages, computes their payloads and digests, and posts
them with a commit record per request. Decode never waits on the network.
A holder that stays unreachable is given up on: its pages stop, and the
control plane places that request's checkpoint elsewhere.
"""

import asyncio
import logging
import re
import time
from collections import defaultdict, deque
from dataclasses import dataclass

import aiohttp

from workers.catalog import BLOCK_TOKENS, NETWORKS, Model, Placement
from workers.kvstore import Page, page_digest, page_from_wire, page_payload

log = logging.getLogger(__name__)

KV_BATCH_PATH = "/agent/kv/batch"
KV_CHECKPOINT_PATH = "/agent/kv/{request_id}"


@dataclass(frozen=True)
class Peer:
    """Another node agent: a checkpoint holder, a migration target, a draft node."""

    name: str
    address: str
    rack: str = ""
    # Its place in the fabric beyond its rack; a gateway from before the fabric was modelled sends none.
    server: str = ""
    nvl_domain: str = ""
    network: str = "infiniband"

    @property
    def placement(self) -> Placement:
        return Placement(self.rack, self.server, self.nvl_domain, self.network)

    @classmethod
    def parse(cls, data, field: str) -> "Peer":
        if not isinstance(data, dict):
            raise ValueError(f"{field}: must be an object with name and address")
        name, address = data.get("name"), data.get("address")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{field}.name: is required")
        if not isinstance(address, str) or not re.match(r"^https?://[^/\s]+$", address):
            raise ValueError(f"{field}.address: must be a base URL such as http://10.0.0.7:8201")
        network = data.get("network") or "infiniband"
        if network not in NETWORKS:
            raise ValueError(f"{field}.network: {network!r} is not a network: expected one of {', '.join(NETWORKS)}")
        return cls(
            name,
            address,
            str(data.get("rack") or ""),
            str(data.get("server") or ""),
            str(data.get("nvl_domain") or ""),
            network,
        )

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "address": self.address,
            "rack": self.rack,
            "server": self.server,
            "nvl_domain": self.nvl_domain,
            "network": self.network,
        }


def make_page(request_id: str, block: int, token_ids: list[int], model: Model, wire_scale: float) -> Page:
    nbytes = model.kv_bytes_per_block
    payload = page_payload(request_id, block, token_ids, max(int(nbytes * wire_scale), 16))
    return Page(block, list(token_ids), nbytes, payload, page_digest(request_id, block, token_ids, payload))


def _breaks_the_stream(refusal: dict) -> bool:
    """A refusal after which the holder can store no later page of the request: out of budget, or
    a page missing before this one. A page sent again after a retry (its seq below the one the
    holder waits for) is a harmless duplicate, and a malformed or corrupt page says nothing of the rest."""
    if refusal.get("reason") == "budget":
        return True
    if refusal.get("reason") == "order":
        expected, seq = refusal.get("expected"), refusal.get("seq")
        return not (isinstance(expected, int) and isinstance(seq, int) and seq < expected)
    return False


class CheckpointStreamer:
    def __init__(
        self,
        source: str,
        model: Model,
        headers: dict,
        wire_scale: float = 1 / 4096,
        flush_s: float = 0.02,
        give_up_s: float = 5.0,
    ):
        self.source = source
        self.model = model
        self.headers = headers
        self.wire_scale = wire_scale
        self.flush_s = flush_s
        self.give_up_s = give_up_s
        self._queues: dict[str, deque] = {}
        self._peers: dict[str, Peer] = {}
        self._wake: dict[str, asyncio.Event] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._seq: dict[tuple[str, str], int] = defaultdict(int)
        self._session: aiohttp.ClientSession | None = None
        self.dead: set[str] = set()
        # (holder, request) whose stream a holder broke off (out of budget, or a page missing): its
        # later pages could not be stored either, so they are not sent; a restore there re-prefills.
        self.refused: set[tuple[str, str]] = set()
        self.counters = {
            "pages_sent": 0,
            "bytes_accounted": 0,
            "bytes_moved": 0,
            "batches": 0,
            "send_failures": 0,
            "pages_refused": 0,
        }

    # --- what the engine calls (never blocks) ---------------------------------------
    @staticmethod
    def _key(holder: Peer) -> str:
        # A holder that restarts comes back at another address: that is another holder.
        return f"{holder.name}@{holder.address}"

    def page(self, holder: Peer, request_id: str, block: int, token_ids: list[int]) -> None:
        key = self._key(holder)
        if key in self.dead or (key, request_id) in self.refused:
            return
        self._seq[(key, request_id)] += 1
        self._queue(holder).append(("page", request_id, self._seq[(key, request_id)], block, list(token_ids)))

    def drop(self, holder: Peer, request_id: str) -> None:
        key = self._key(holder)
        self._seq.pop((key, request_id), None)
        self.refused.discard((key, request_id))
        if key not in self.dead:
            self._queue(holder).append(("drop", request_id))

    def _queue(self, holder: Peer) -> deque:
        key = self._key(holder)
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = deque()
            self._peers[key] = holder
            self._wake[key] = asyncio.Event()
            self._tasks[key] = asyncio.get_running_loop().create_task(self._send_loop(key), name=f"kv-to-{key}")
        self._wake[key].set()
        return queue

    def pending(self) -> int:
        return sum(len(q) for q in self._queues.values())

    # --- the sender ------------------------------------------------------------------------
    async def _send_loop(self, key: str) -> None:
        queue = self._queues[key]
        peer = self._peers[key]
        name = key
        failing_since = None
        while True:
            await self._wake[name].wait()
            self._wake[name].clear()
            await asyncio.sleep(self.flush_s)  # let a batch gather
            while queue:
                items = [queue.popleft() for _ in range(min(len(queue), 512))]
                body = self._batch(items)
                try:
                    answer = await self._post(peer, body)
                    failing_since = None
                    self._stop_refused(name, answer.get("refused") or [], queue)
                except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                    self.counters["send_failures"] += 1
                    failing_since = failing_since or time.monotonic()
                    if time.monotonic() - failing_since > self.give_up_s:
                        log.warning("giving up on holder %s after %.0f s: %s", name, self.give_up_s, exc)
                        self.dead.add(name)
                        queue.clear()
                        return
                    queue.extendleft(reversed(items))  # keep the order for the retry
                    await asyncio.sleep(0.2)

    def _stop_refused(self, key: str, refused: list[dict], queue: deque) -> None:
        stopped = {r["request_id"] for r in refused if r.get("request_id") is not None and _breaks_the_stream(r)}
        if not stopped:
            return
        self.refused.update((key, request_id) for request_id in stopped)
        kept = [item for item in queue if not (item[0] == "page" and item[1] in stopped)]
        queue.clear()
        queue.extend(kept)

    def _batch(self, items: list[tuple]) -> dict:
        pages, commits, drops = [], {}, []
        for item in items:
            if item[0] == "page":
                _, request_id, seq, block, token_ids = item
                page = make_page(request_id, block, token_ids, self.model, self.wire_scale)
                pages.append(page.to_wire(request_id, seq))
                commits[request_id] = {"request_id": request_id, "seq": seq, "tokens": (block + 1) * BLOCK_TOKENS}
                self.counters["bytes_accounted"] += page.nbytes
                self.counters["bytes_moved"] += len(page.payload)
            else:
                drops.append(item[1])
                commits.pop(item[1], None)
        return {
            "source": self.source,
            "model": self.model.key,
            "pages": pages,
            "commits": list(commits.values()),
            "drops": drops,
        }

    async def _post(self, peer: Peer, body: dict) -> dict:
        if self._session is None:
            self._session = aiohttp.ClientSession(headers=self.headers, timeout=aiohttp.ClientTimeout(total=5))
        async with self._session.post(peer.address + KV_BATCH_PATH, json=body) as response:
            answer = await response.json(content_type=None)
            if response.status != 200:
                raise aiohttp.ClientResponseError(
                    response.request_info, (), status=response.status, message=str(answer)
                )
        self.counters["batches"] += 1
        self.counters["pages_sent"] += len(body["pages"])
        self.counters["pages_refused"] += len(answer.get("refused", []))
        return answer

    async def push_all(self, peer: Peer, request_id: str, blocks: list[list[int]], direct: bool) -> int:
        """Send a request's blocks to `peer` now, as one stream from seq 1 (a live migration)."""
        pages = [
            make_page(request_id, i, ids, self.model, self.wire_scale).to_wire(request_id, i + 1)
            for i, ids in enumerate(blocks)
        ]
        commits = [{"request_id": request_id, "seq": len(pages), "tokens": len(pages) * BLOCK_TOKENS}] if pages else []
        body = {
            "source": self.source,
            "model": self.model.key,
            "pages": pages,
            "commits": commits,
            "drops": [],
            "direct": direct,
        }
        answer = await self._post(peer, body)
        return answer.get("committed", {}).get(request_id, 0)

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    def stats(self) -> dict:
        return {**self.counters, "pending": self.pending(), "dead_holders": sorted(self.dead)}


async def fetch_checkpoint(
    holder: Peer, request_id: str, headers: dict, timeout_s: float = 10.0
) -> tuple[list[Page], int]:
    """A request's pages from another holder, each checked against its digest."""
    url = holder.address + KV_CHECKPOINT_PATH.format(request_id=request_id)
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        async with session.get(url) as response:
            if response.status == 404:
                return [], 0
            if response.status != 200:
                raise aiohttp.ClientResponseError(
                    response.request_info, (), status=response.status, message=await response.text()
                )
            body = await response.json()
    pages: list[Page] = []
    for data in body["pages"]:
        _, _, page = page_from_wire(data)
        if page_digest(request_id, page.block, page.token_ids, page.payload) != page.digest or page.block != len(pages):
            break  # a corrupt or missing page: keep the verified prefix
        pages.append(page)
    committed = min(int(body.get("committed_tokens", 0)), len(pages) * BLOCK_TOKENS)
    return pages, committed
