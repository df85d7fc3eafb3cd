"""The holder side of KV checkpointing: other nodes' KV pages in host memory.

Pages arrive in order, one 16-token block each, tagged with a per-request
sequence number and a digest; a commit record then says which token the
checkpoint is complete up to (source documents 000 and 001). A page with a
wrong digest or out of order is refused and counted, and the checkpoint stays
at its last committed token. The store keeps to a byte budget: under pressure
it evicts the checkpoints with the shortest checkpointed prefix first, since
those are the cheapest to recompute. Bytes are accounted at their real KV
size even when the bytes moved are scaled down.
"""

import base64
import hashlib
import time
from dataclasses import dataclass, field

from workers.catalog import BLOCK_TOKENS
from workers.protocol import ProtocolError


def page_digest(request_id: str, block: int, token_ids: list[int], payload: bytes) -> str:
    h = hashlib.blake2b(digest_size=16, person=b"lifeline-kvpage")
    h.update(request_id.encode())
    h.update(block.to_bytes(4, "little"))
    for token_id in token_ids:
        h.update(token_id.to_bytes(8, "little"))
    h.update(payload)
    return h.hexdigest()


def page_payload(request_id: str, block: int, token_ids: list[int], size: int) -> bytes:
    """Stand-in bytes for a block's K and V tensors: deterministic, `size` long."""
    seed = hashlib.blake2b(f"{request_id}/{block}/{token_ids}".encode(), digest_size=32).digest()
    return (seed * (size // len(seed) + 1))[:size]


@dataclass
class Page:
    block: int
    token_ids: list[int]
    nbytes: int  # accounted: the real size of the block's KV
    payload: bytes  # moved: possibly scaled down
    digest: str

    def to_wire(self, request_id: str, seq: int) -> dict:
        return {
            "request_id": request_id,
            "seq": seq,
            "block": self.block,
            "tokens": self.token_ids,
            "nbytes": self.nbytes,
            "payload": base64.b64encode(self.payload).decode(),
            "digest": self.digest,
        }


class PageRefused(Exception):
    def __init__(self, reason: str, message: str, expected: int | None = None):
        super().__init__(message)
        self.reason = reason  # "digest", "order" or "budget"
        self.expected = expected  # for "order": the page the holder waits for


@dataclass
class Checkpoint:
    request_id: str
    source: str
    model: str
    pages: list[Page] = field(default_factory=list)
    last_seq: int = 0
    committed_tokens: int = 0
    nbytes: int = 0
    updated_at: float = field(default_factory=time.time)
    direct: bool = False  # handed over by a live migration, straight into GPU memory

    @property
    def token_ids(self) -> list[int]:
        return [t for page in self.pages for t in page.token_ids]

    def summary(self) -> dict:
        return {
            "request_id": self.request_id,
            "source": self.source,
            "model": self.model,
            "blocks": len(self.pages),
            "committed_tokens": self.committed_tokens,
            "bytes": self.nbytes,
            "updated_at": self.updated_at,
        }


class CheckpointStore:
    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.checkpoints: dict[str, Checkpoint] = {}
        self.bytes_held = 0
        self.counters = {
            "pages_stored": 0,
            "refused_digest": 0,
            "refused_order": 0,
            "refused_budget": 0,
            "evicted": 0,
            "dropped": 0,
        }

    def put(self, source: str, model: str, request_id: str, seq: int, page: Page, direct: bool = False) -> None:
        """Store one page; raise PageRefused (and count it) when it cannot be accepted."""
        if page_digest(request_id, page.block, page.token_ids, page.payload) != page.digest:
            self.counters["refused_digest"] += 1
            raise PageRefused("digest", f"page {seq} of {request_id} fails its digest check")
        if seq == 1:
            # A new stream for this request (a new serving node, or a live migration): start over.
            self.drop(request_id, count=False)
        checkpoint = self.checkpoints.get(request_id)
        expected = (checkpoint.last_seq + 1) if checkpoint else 1
        expected_block = len(checkpoint.pages) if checkpoint else 0
        if seq != expected or page.block != expected_block:
            self.counters["refused_order"] += 1
            raise PageRefused(
                "order",
                f"page {seq} (block {page.block}) of {request_id} is out of order: "
                f"expected page {expected} (block {expected_block})",
                expected,
            )
        if not self._make_room(page.nbytes, request_id):
            self.counters["refused_budget"] += 1
            self.drop(request_id, count=False)
            raise PageRefused("budget", f"no room for {request_id} within the {self.budget_bytes} byte budget")
        if checkpoint is None:
            checkpoint = self.checkpoints[request_id] = Checkpoint(request_id, source, model, direct=direct)
        checkpoint.pages.append(page)
        checkpoint.last_seq = seq
        checkpoint.nbytes += page.nbytes
        checkpoint.updated_at = time.time()
        self.bytes_held += page.nbytes
        self.counters["pages_stored"] += 1

    def commit(self, request_id: str, seq: int, tokens: int) -> int | None:
        """Mark the checkpoint complete up to `tokens`, if every page up to `seq` is here."""
        checkpoint = self.checkpoints.get(request_id)
        if checkpoint is None or seq > checkpoint.last_seq:
            return None
        checkpoint.committed_tokens = max(
            checkpoint.committed_tokens, min(tokens, len(checkpoint.pages) * BLOCK_TOKENS)
        )
        return checkpoint.committed_tokens

    def drop(self, request_id: str, count: bool = True) -> bool:
        checkpoint = self.checkpoints.pop(request_id, None)
        if checkpoint is None:
            return False
        self.bytes_held -= checkpoint.nbytes
        if count:
            self.counters["dropped"] += 1
        return True

    def _make_room(self, nbytes: int, keep: str) -> bool:
        """Evict checkpoints with a shorter prefix than `keep` will have, shortest first.

        A request new to a full holder would have the shortest prefix of all,
        so it is refused and its serving node checkpoints elsewhere or not at
        all (source document 000, eq. 5); growing long checkpoints push out short ones.
        """
        own = self.checkpoints.get(keep)
        prefix_after = (len(own.pages) if own else 0) * BLOCK_TOKENS + BLOCK_TOKENS
        while self.bytes_held + nbytes > self.budget_bytes:
            candidates = [
                c for c in self.checkpoints.values() if c.request_id != keep and c.committed_tokens < prefix_after
            ]
            if not candidates:
                return False
            victim = min(candidates, key=lambda c: (c.committed_tokens, c.updated_at))
            self.drop(victim.request_id, count=False)
            self.counters["evicted"] += 1
        return True

    def usable(self, request_id: str, context: list[int]) -> tuple[Checkpoint | None, int]:
        """The checkpoint for `request_id` and how many of `context`'s tokens it restores.

        Only committed, whole blocks count, and only while their tokens match
        the context the request is resumed with.
        """
        checkpoint = self.checkpoints.get(request_id)
        if checkpoint is None:
            return None, 0
        limit = min(checkpoint.committed_tokens, len(context)) // BLOCK_TOKENS * BLOCK_TOKENS
        restored = 0
        for page in checkpoint.pages:
            end = restored + len(page.token_ids)
            if end > limit or page.token_ids != context[restored:end]:
                break
            restored = end
        return checkpoint, restored

    def by_source(self) -> dict[str, dict]:
        """Bytes and requests held per serving node: the checkpoint distribution, seen from this holder."""
        summary: dict[str, dict] = {}
        for checkpoint in self.checkpoints.values():
            entry = summary.setdefault(checkpoint.source, {"bytes": 0, "requests": 0})
            entry["bytes"] += checkpoint.nbytes
            entry["requests"] += 1
        return summary

    def stats(self) -> dict:
        return {
            "bytes_held": self.bytes_held,
            "budget_bytes": self.budget_bytes,
            "requests": len(self.checkpoints),
            **self.counters,
        }


PAGE_FIELDS = ("request_id", "seq", "block", "tokens", "nbytes", "payload", "digest")
MAX_BLOCK = 2**32 - 1  # the digest holds a block's index in 4 bytes, each token id in 8
MAX_TOKEN_ID = 2**64 - 1


def _whole(data: dict, key: str, where: str, low: int, high: int) -> int:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ProtocolError(f"{where}.{key}", f"must be a whole number from {low} to {high}, not {value!r:.40}")
    return value


def page_from_wire(data, where: str = "page") -> tuple[str, int, Page]:
    """(request_id, seq, page) from one page of a batch; ProtocolError (a ValueError) names the bad field."""
    if not isinstance(data, dict):
        raise ProtocolError(where, f"must be an object with {', '.join(PAGE_FIELDS)}")
    missing = [key for key in PAGE_FIELDS if key not in data]
    if missing:
        raise ProtocolError(f"{where}.{missing[0]}", "is required")
    if not isinstance(data["request_id"], str) or not data["request_id"]:
        raise ProtocolError(f"{where}.request_id", "must be the request's id, a string")
    seq = _whole(data, "seq", where, 1, 2**63 - 1)
    block = _whole(data, "block", where, 0, MAX_BLOCK)
    nbytes = _whole(data, "nbytes", where, 0, 2**63 - 1)
    tokens = data["tokens"]
    if not isinstance(tokens, list) or len(tokens) != BLOCK_TOKENS:
        raise ProtocolError(f"{where}.tokens", f"a page holds {BLOCK_TOKENS} token ids")
    for i, token_id in enumerate(tokens):
        if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id <= MAX_TOKEN_ID:
            raise ProtocolError(f"{where}.tokens[{i}]", f"must be a token id, not {token_id!r:.40}")
    if not isinstance(data["digest"], str):
        raise ProtocolError(f"{where}.digest", "must be the page's digest, a hex string")
    try:
        payload = base64.b64decode(data["payload"], validate=True)
    except (TypeError, ValueError):
        raise ProtocolError(f"{where}.payload", "must be the page's bytes in base64") from None
    page = Page(block=block, token_ids=list(tokens), nbytes=nbytes, payload=payload, digest=data["digest"])
    return data["request_id"], seq, page
