"""The node lifecycle as a monotone state (source document 004).

Within one session (one run of a node process) the state only moves forward:
JOIN -> SERVING -> DOWN -> LEFT, as in a grow-only CRDT whose merge keeps the
highest state. A node that comes back after DOWN or LEFT starts a new session,
which begins at JOIN again; its history stays with the node.
"""

import datetime as dt

JOIN = "join"
SERVING = "serving"
DOWN = "down"
LEFT = "left"

ORDER = (JOIN, SERVING, DOWN, LEFT)
RANK = {state: i for i, state in enumerate(ORDER)}
ALIVE = (JOIN, SERVING)


class IllegalTransition(ValueError):
    def __init__(self, old: str, new: str, reason: str):
        super().__init__(f"{old} -> {new} is not allowed: {reason}")
        self.old = old
        self.new = new


def check(old: str | None, new: str, new_session: bool) -> None:
    """Raise IllegalTransition unless `old -> new` is a legal lifecycle step."""
    if new not in RANK:
        raise IllegalTransition(str(old), new, f"unknown state; expected one of {', '.join(ORDER)}")
    if old is None or new_session:
        if new != JOIN:
            raise IllegalTransition(str(old), new, "a new session starts at join")
        return
    if RANK[new] <= RANK[old]:
        raise IllegalTransition(old, new, "within one session the lifecycle only moves forward")


def merge(a: str, b: str) -> str:
    """The CRDT merge of two views of one session's state: the later state wins."""
    return a if RANK[a] >= RANK[b] else b


def is_silent(last_seen: float, now: float, miss_s: float) -> bool:
    """A node whose last heartbeat is older than the allowed miss is DOWN."""
    return now - last_seen > miss_s


def of_a_previous_run(session_started: dt.datetime | None, heard: float | None, started: dt.datetime | None) -> bool:
    """A node's session began before the control plane started and has sent no heartbeat since: it ended while the
    control plane was down (a restart of the stack), and its node is judged by when it started, not failed."""
    return (
        started is not None
        and session_started is not None
        and session_started < started
        and (heard is None or heard < started.timestamp())
    )
