"""The node lifecycle policy: monotone within a session (source document 004)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from recovery.policy import lifecycle as lc


def test_forward_steps_are_allowed():
    lc.check(lc.JOIN, lc.SERVING, new_session=False)
    lc.check(lc.SERVING, lc.DOWN, new_session=False)
    lc.check(lc.DOWN, lc.LEFT, new_session=False)
    lc.check(lc.JOIN, lc.DOWN, new_session=False)  # died while loading
    lc.check(lc.SERVING, lc.LEFT, new_session=False)  # left on purpose


@pytest.mark.parametrize(
    "old,new", [(lc.SERVING, lc.JOIN), (lc.DOWN, lc.SERVING), (lc.LEFT, lc.DOWN), (lc.SERVING, lc.SERVING)]
)
def test_backward_steps_within_a_session_are_refused(old, new):
    with pytest.raises(lc.IllegalTransition, match="only moves forward"):
        lc.check(old, new, new_session=False)


def test_a_new_session_starts_at_join_from_anywhere():
    for old in lc.ORDER:
        lc.check(old, lc.JOIN, new_session=True)
    with pytest.raises(lc.IllegalTransition, match="starts at join"):
        lc.check(lc.DOWN, lc.SERVING, new_session=True)


def test_silence():
    assert lc.is_silent(last_seen=100.0, now=103.5, miss_s=3.0)
    assert not lc.is_silent(last_seen=100.0, now=102.9, miss_s=3.0)


@given(st.lists(st.sampled_from(lc.ORDER), min_size=1, max_size=30))
def test_merge_is_a_join_semilattice(states):
    # Any order of merging the same observations gives the same, highest state.
    merged = states[0]
    for state in states[1:]:
        merged = lc.merge(merged, state)
    assert merged == max(states, key=lc.RANK.get)
    assert lc.merge(states[0], states[-1]) == lc.merge(states[-1], states[0])


@given(st.lists(st.tuples(st.sampled_from(lc.ORDER), st.booleans()), max_size=40))
def test_applied_transitions_never_move_backward_within_a_session(steps):
    state, session, history = None, 0, []
    for new, new_session in steps:
        try:
            lc.check(state, new, new_session)
        except lc.IllegalTransition:
            continue
        session += new_session or state is None
        history.append((session, new))
        state = new
    for (s1, a), (s2, b) in zip(history, history[1:]):
        if s1 == s2:
            assert lc.RANK[b] > lc.RANK[a]
        else:
            assert b == lc.JOIN
