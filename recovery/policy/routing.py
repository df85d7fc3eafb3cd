"""Choosing a node for a request.

The foundation routes round-robin among the nodes the control plane allows;
load-aware routing (source document 002) replaces it in the recovery work.
"""

from collections.abc import Sequence


class RoundRobin:
    def __init__(self):
        self._next: dict[str, int] = {}

    def choose(self, model: str, candidates: Sequence[str], exclude: frozenset[str] = frozenset()) -> str | None:
        """The next candidate for `model` in turn, skipping `exclude`; None when none is left."""
        allowed = [name for name in sorted(candidates) if name not in exclude]
        if not allowed:
            return None
        turn = self._next.get(model, 0)
        self._next[model] = turn + 1
        return allowed[turn % len(allowed)]
