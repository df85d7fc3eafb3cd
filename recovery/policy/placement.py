"""Where a request's KV checkpoint lives (source document 000, Algorithm 1 and eq. 5; DESIGN.md).

The serving node streams each request's KV pages to the host memory of one or
two holders; when the serving node fails, a holder restores the request without
a prefill. The policy decides who holds, and so how recovery work spreads.
"""

import bisect
import math
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import attrgetter, ge, is_not

POLICIES = ("none", "fixed", "load_aware", "lifeline")

POLICY_DOCS = {
    "none": "Stop-and-restart: no checkpoint; a failure re-prefills every interrupted request.",
    "fixed": (
        "DéjàVu's fixed neighbour: the next alive node after the serving one in name order, whatever its load. "
        "When that neighbour's budget is full the request gets no checkpoint: DéjàVu has no second choice, "
        "which is how it degrades under memory pressure."
    ),
    "load_aware": (
        "LUMEN Algorithm 1: the other node with the least recovery load L̂ (eq. 4) within its host-memory "
        "budget (eq. 5); a full holder passes to the next least loaded; no checkpoint when none has room."
    ),
    "lifeline": (
        "load_aware, plus a second holder in another rack when the request's prefix exceeds τ, so a rack "
        "failure does not take both copies; the caller also checkpoints completed prefill chunks."
    ),
}


@dataclass(frozen=True)
class HolderCandidate:
    """A node that could hold a checkpoint: its rack, recovery load and host-memory budget."""

    name: str
    rack: str
    l_hat: float
    bytes_held: int
    budget_bytes: int
    alive: bool = True
    # What a second copy may still take here (SECOND_COPY_SHARE of the budget less what it holds): kept with the
    # candidate so a placement can skip, at C speed, the holders too full for one.
    second_room: float = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "second_room", SECOND_COPY_SHARE * self.budget_bytes - self.bytes_held)


_L_HAT = attrgetter("l_hat")
_SECOND_ROOM = attrgetter("second_room")
_NAME = attrgetter("name")
_RACK = attrgetter("rack")
_L_HAT_NAME = attrgetter("l_hat", "name")
_QUICK_PICKS = 8  # candidates a scan takes one min() at a time before it sorts the rest
_KEPT = 8  # candidate lists remembered across calls


def _scan(items: list) -> Iterator[HolderCandidate]:
    """The candidates in (L̂, name) order, lazily, without a sort.

    A placement needs one or two of them, so the first few come from min()
    over a list of floats (C speed); a caller that wants more gets the rest
    sorted once.
    """
    loads = list(map(_L_HAT, items))
    taken: set[int] = set()
    for _ in range(_QUICK_PICKS):
        if len(taken) == len(loads):
            return
        least = min(loads)
        if least != least or least == math.inf:  # NaN or inf: the sort below orders them
            break
        tied = [loads.index(least)]
        for _ in range(loads.count(least) - 1):  # equal L̂ is common: L̂ counts pages and requests
            tied.append(loads.index(least, tied[-1] + 1))
        if len(tied) > 1:
            tied.sort(key=lambda i: items[i].name)
        for i in tied:
            loads[i] = math.inf
            taken.add(i)
            yield items[i]
    yield from sorted((c for i, c in enumerate(items) if i not in taken), key=_L_HAT_NAME)


class _Ranking:
    """A candidate list kept in (L̂, name) order across calls.

    The gateway places every request among the same few hundred nodes, and
    between two requests only the nodes whose L̂ moved change. A list seen
    again with few entries replaced (by identity) is sorted once and then
    kept in order by re-ranking only those; a list rebuilt from new objects
    for every call is scanned instead (`_scan`), which needs no sort. So keep
    one list per pool with every node in it (place() skips the serving one
    itself) and replace a HolderCandidate (it is frozen) when its node's L̂,
    budget or liveness changes.
    """

    def __init__(self, items: list):
        self.items = items
        self.order: list | None = None  # (L̂, name, slot), sorted on the second sighting with few changes
        self.ordered: list[HolderCandidate] = []  # the candidates in that order
        self.rooms: list[float] = []  # and their second_room, in that order

    def _sort(self) -> None:
        self.order = sorted((c.l_hat, c.name, i) for i, c in enumerate(self.items))
        self.ordered = [self.items[i] for _l, _n, i in self.order]
        self.rooms = list(map(_SECOND_ROOM, self.ordered))

    def update(self, items: list) -> bool:
        """Take the new entries; False when too many changed to keep an order (scan instead)."""
        if len(items) != len(self.items):
            return False
        moved = list(map(is_not, items, self.items))  # identity only: comparing values costs more
        count = moved.count(True)
        if count > 8 + len(items) // 8:
            return False
        changed, i = [], -1
        for _ in range(count):
            i = moved.index(True, i + 1)
            changed.append(i)
        if self.order is None:
            self.items = items
            self._sort()
            return True
        for i in changed:
            if not self._rerank(i, items[i]):
                return False
        self.items = items
        return True

    def _rerank(self, i: int, new: HolderCandidate) -> bool:
        """Move entry `i` to where `new` ranks; False when the old entry cannot be found (NaN L̂, mutated)."""
        old = self.items[i]
        key = (old.l_hat, old.name, i)
        order = self.order
        assert order is not None, "update() sorts before it re-ranks; a HolderRanking is sorted from the start"
        at = bisect.bisect_left(order, key)
        if at >= len(order) or order[at] != key:
            return False
        del order[at], self.ordered[at], self.rooms[at]
        key = (new.l_hat, new.name, i)
        at = bisect.bisect_left(order, key)
        order.insert(at, key)
        self.ordered.insert(at, new)
        self.rooms.insert(at, new.second_room)
        return True

    def __iter__(self) -> Iterator[HolderCandidate]:
        assert self.order is not None, "iterated only after update() kept an order, or as a HolderRanking"
        return iter(self.ordered)

    def with_second_room(self, request_bytes: int) -> Iterator[HolderCandidate]:
        """In order, only the candidates with room for a second copy of `request_bytes`: the others, often most of
        a loaded fleet, are skipped without a Python-level step each."""
        return compress(self.ordered, map(ge, self.rooms, repeat(request_bytes)))


class HolderRanking(_Ranking):
    """A pool's holder candidates kept in (L̂, name) order as they change one at a time.

    The gateway replaces a node's candidate when its L̂, budget or liveness
    changes (`set`), at the moment it learns of it, so `place` given this
    ranking only reads the order. The pool's names are fixed; build a new
    ranking when they change. L̂ must not be NaN.
    """

    def __init__(self, candidates: Sequence[HolderCandidate]):
        super().__init__(list(candidates))
        self._sort()
        self.slot = {c.name: i for i, c in enumerate(self.items)}
        self.racks = Counter(map(_RACK, self.items))  # candidates per rack: one rack or several, known at once

    def __len__(self) -> int:
        return len(self.items)

    def set(self, candidate: HolderCandidate) -> None:
        i = self.slot[candidate.name]
        if not self._rerank(i, candidate):
            raise ValueError(f"cannot re-rank {candidate.name}: its entry was changed in place or its L̂ is NaN")
        old = self.items[i]
        if old.rack != candidate.rack:
            self.racks[old.rack] -= 1
            if not self.racks[old.rack]:
                del self.racks[old.rack]
            self.racks[candidate.rack] += 1
        self.items[i] = candidate

    def one_rack(self) -> bool:
        return len(self.racks) == 1


_rankings: dict[int, _Ranking] = {}
_lock = threading.Lock()


def _by_load(
    candidates: "Sequence[HolderCandidate] | HolderRanking",
) -> tuple[Iterator[HolderCandidate], _Ranking | None]:
    """The candidates in order of (L̂, name), and the ranking that keeps that order if there is one: the caller's
    HolderRanking, the ranking kept for this list, or (None) a scan."""
    if isinstance(candidates, HolderRanking):
        return iter(candidates), candidates
    items = list(candidates)
    ranking = _rankings.get(id(candidates))
    if ranking is not None and ranking.update(items):
        return iter(ranking), ranking
    if ranking is not None:
        ranking.items, ranking.order = items, None  # changed too much: start over
    else:
        while len(_rankings) >= _KEPT:
            del _rankings[next(iter(_rankings))]  # the oldest, one at a time
        _rankings[id(candidates)] = _Ranking(items)
    return _scan(items), None


def _fits(c: HolderCandidate, serving: str, request_bytes: int) -> bool:
    """Alive, not the serving node, and within its budget after this request (eq. 5)."""
    return c.alive and c.name != serving and c.bytes_held + request_bytes <= c.budget_bytes


# A second copy may fill a holder's checkpoint budget only this far. Budgets fill under load (5 % of host memory
# holds a few dozen long contexts), and a second copy that takes the last room leaves a later request with no
# first copy at all: in the simulator, 30 of 69 requests on a failed worker had no holder under lifeline against
# 16 under load_aware, and lifeline's mean TTFT was 22 % worse (benchmarks/results/lumen_ablations.json).
SECOND_COPY_SHARE = 0.5


def second_copy_fits(bytes_held: int, budget_bytes: int, request_bytes: int) -> bool:
    """Whether a holder has spare room for a request's second copy: within SECOND_COPY_SHARE of its budget."""
    return bytes_held + request_bytes <= SECOND_COPY_SHARE * budget_bytes


def _fixed_neighbour(serving: str, candidates: "Sequence[HolderCandidate] | HolderRanking") -> HolderCandidate | None:
    alive = [c for c in candidates if c.alive and c.name != serving]
    after = [c for c in alive if c.name > serving]
    return min(after or alive, key=_NAME, default=None)


def place(
    policy: str,
    serving: str,
    candidates: "Sequence[HolderCandidate] | HolderRanking",
    request_bytes: int,
    prefix_tokens: int,
    tau: int = 512,
) -> tuple[str, ...]:
    """The checkpoint holders of a request served on `serving`: none, one or two names.

    Never the serving node, never a dead node, never one whose budget this
    request would overflow (eq. 5). Ties in L̂ go to the smallest name.
    `candidates` is a sequence, or a HolderRanking a caller keeps current.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown placement policy {policy!r}: expected one of {', '.join(POLICIES)}")
    if policy == "none":
        return ()
    if policy == "fixed":
        neighbour = _fixed_neighbour(serving, candidates)
        return (neighbour.name,) if neighbour and _fits(neighbour, serving, request_bytes) else ()

    with _lock:
        ordered, ranking = _by_load(candidates)
        first = next((c for c in ordered if _fits(c, serving, request_bytes)), None)
        if first is None:
            return ()
        if policy == "load_aware" or prefix_tokens <= tau:
            return (first.name,)
        # lifeline: a second copy for a long prefix, in another rack if any has room. The same walk in (L̂, name)
        # order either way; a kept ranking skips the holders without room for it at C speed.
        if ranking is not None:
            ordered = ranking.with_second_room(request_bytes)
        same_rack = None
        for c in ordered:
            if c is first or not _fits(c, serving, request_bytes):
                continue
            if not second_copy_fits(c.bytes_held, c.budget_bytes, request_bytes):
                continue
            if c.rack != first.rack:
                return (first.name, c.name)
            if same_rack is None:
                same_rack = c
                if (
                    candidates.one_rack()
                    if isinstance(candidates, HolderRanking)
                    else all(rack == first.rack for rack in map(_RACK, candidates))
                ):
                    break  # one rack only: the least loaded other node is the best second copy
        return (first.name, same_rack.name) if same_rack else (first.name,)


def holder_balance(l_hats: Sequence[float]) -> float | None:
    """max/min of the holders' L̂, document 000's balance figure (goal: under 1.5).

    None with fewer than two holders; 1.0 when all are 0 (nothing to balance);
    math.inf when the least is 0 and another is not: an idle holder beside a
    loaded one is the worst imbalance, and a ratio with an epsilon would only
    hide it behind an arbitrary large number.
    """
    if len(l_hats) < 2:
        return None
    low, high = min(l_hats), max(l_hats)
    if low <= 0:
        return 1.0 if high <= 0 else math.inf
    return high / low


def coverage(in_flight: int, with_usable_checkpoint: int) -> float | None:
    """The share of in-flight requests a failure could restore without re-prefill; None with none in flight."""
    if in_flight <= 0:
        return None
    return min(1.0, max(0, with_usable_checkpoint) / in_flight)
