"""A canary pass returns only a SUSPICIOUS node; an UNHEALTHY one comes back through its breaker's half-open trial,
and never while a drain holds it (source document 003, issue 17).

The policy on its own (pure), then the real action path: `health.record_canary` against the database, with the
node taken out by a CRITICAL Xid (its breaker stays closed, so its canaries keep running) and its drain proposed by
the reaction, as in production."""

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from recovery.actions import drains, health
from recovery.choices import BreakerState, DrainState, Health, HealthChange
from recovery.models import Drain, HealthTransition, Node
from recovery.policy import breaker as breakers
from recovery.policy import health as policy
from tests.recovery.test_health import configure, register, weight

OK = policy.Verdict(True, "ok", "1 token matches, 12.0 ms")
WRONG = policy.Verdict(False, "token_mismatch", "token 0: expected 7, got 9 (1 of 1 tokens)")


# --- the policy ---------------------------------------------------------------------------------------------------
def test_a_pass_returns_a_suspicious_node_at_once():
    assert policy.after_canary(policy.SUSPICIOUS, 2, True) == policy.HealthStep(policy.HEALTHY, 0, False)


def test_a_pass_on_an_unhealthy_node_with_a_closed_breaker_only_starts_the_half_open_trial():
    step = policy.after_canary(policy.UNHEALTHY, 3, True, breaker=breakers.CLOSED)
    assert step == policy.HealthStep(policy.UNHEALTHY, 0, False, half_open=True)


def test_a_pass_on_an_unhealthy_node_with_an_open_breaker_waits_for_the_breakers_timeout():
    step = policy.after_canary(policy.UNHEALTHY, 3, True, breaker=breakers.OPEN)
    assert step == policy.HealthStep(policy.UNHEALTHY, 0, False, half_open=False)


def test_the_half_open_trial_decides_healthy_or_unhealthy():
    assert policy.after_canary(policy.UNHEALTHY, 0, True, breaker=breakers.HALF_OPEN).state == policy.HEALTHY
    failed = policy.after_canary(policy.UNHEALTHY, 0, False, breaker=breakers.HALF_OPEN)
    assert failed == policy.HealthStep(policy.UNHEALTHY, 1, False)  # back to UNHEALTHY, no second drain proposed


@pytest.mark.parametrize("breaker", breakers.STATES)
def test_a_node_held_by_a_drain_is_never_returned_by_a_pass(breaker):
    step = policy.after_canary(policy.UNHEALTHY, 3, True, breaker=breaker, held=True)
    assert step == policy.HealthStep(policy.UNHEALTHY, 0, False, half_open=False)


def test_an_unknown_breaker_state_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown breaker state 'ajar'"):
        policy.after_canary(policy.UNHEALTHY, 3, True, breaker="ajar")


def test_the_breaker_goes_half_open_with_its_trial_still_to_run():
    half = breakers.Breaker().to_half_open()
    assert (half.state, half.trial_at) == (breakers.HALF_OPEN, None)
    allowed, out = half.allow(100.0)
    assert allowed and out.trial_at == 100.0
    assert not out.allow(101.0)[0]  # one trial only
    assert out.on_success() == breakers.Breaker()
    assert out.on_failure(102.0).state == breakers.OPEN


@given(st.lists(st.tuples(st.booleans(), st.booleans()), max_size=60))
def test_an_unhealthy_node_returns_only_by_a_passed_trial_with_no_drain_holding_it(results):
    """The health machine and the breaker composed as `record_canary` composes them, over any run of results."""
    state, failures, breaker, now = policy.HEALTHY, 0, breakers.Breaker(), 0.0
    for passed, held in results:
        now += 30.0
        allowed, breaker = breaker.allow(now)
        if not allowed:
            continue  # the scheduler sends no canary to an open breaker
        step = policy.after_canary(state, failures, passed, breaker=breaker.state, held=held)
        after = breaker.on_success() if passed else breaker.on_failure(now)
        if step.half_open:
            after = after.to_half_open()
        if state == policy.UNHEALTHY and step.state == policy.HEALTHY:
            assert passed and breaker.state == breakers.HALF_OPEN and not held
        if state == policy.UNHEALTHY:
            assert step.state in (policy.UNHEALTHY, policy.HEALTHY)  # never half-way back to SUSPICIOUS
        if step.state == policy.HEALTHY:
            assert after.state == breakers.CLOSED  # in service only with the breaker closed
        state, failures, breaker = step.state, step.failures, after


# --- the action path, with the database -------------------------------------------------------------------------
def taken_out_by_xid(commit, react, name):
    """A serving node made UNHEALTHY by a CRITICAL Xid, with the drain its reaction proposes."""
    node, _ = commit(register, name)
    configure(auto_cordon_max_share=1.0)
    commit(health.ingest_xids, name, [{"at": time.time(), "gpu": 0, "code": 79}])
    react()
    node.refresh_from_db()
    assert node.health == Health.UNHEALTHY and node.breaker == BreakerState.CLOSED and weight(name) == 0.0
    return node, Drain.objects.get(node=node, state=DrainState.PROPOSED)


def approve(commit, drain, cast):
    for who in ("oncall", "admin"):
        drain.refresh_from_db()
        if drain.state == DrainState.PROPOSED:
            commit(drains.decide, drain, cast[who], "approve", "GPU fell off the bus")
    drain.refresh_from_db()
    assert drain.state == DrainState.APPROVED


@pytest.mark.django_db
@pytest.mark.parametrize("decided", [False, True], ids=["proposed", "approved"])
def test_a_canary_pass_never_puts_back_a_node_whose_drain_is_open(commit, react, tokens, cast, decided):
    node, drain = taken_out_by_xid(commit, react, "hh-held")
    if decided:
        approve(commit, drain, cast)
    rows = HealthTransition.objects.filter(node=node).count()
    for _ in range(3):
        result = commit(health.record_canary, node, OK, 12.0)
        assert result.passed
    node.refresh_from_db()
    assert node.health == Health.UNHEALTHY and node.breaker == BreakerState.CLOSED and weight("hh-held") == 0.0
    assert node.canary_failures == 0
    assert HealthTransition.objects.filter(node=node).count() == rows  # nothing changed: no row
    # Nor does a half-open trial's pass while the drain holds it: the breaker closes, the node stays out.
    Node.objects.filter(pk=node.pk).update(breaker=BreakerState.HALF_OPEN)
    commit(health.record_canary, node, OK, 12.0, trial=True)
    node.refresh_from_db()
    assert node.health == Health.UNHEALTHY and node.breaker == BreakerState.CLOSED and weight("hh-held") == 0.0
    row = HealthTransition.objects.filter(node=node, kind=HealthChange.BREAKER).latest("at")
    assert row.new == BreakerState.CLOSED and "its drain holds it" in row.cause


@pytest.mark.django_db
def test_an_unhealthy_node_returns_through_the_half_open_trial(commit, react, tokens, cast):
    node, drain = taken_out_by_xid(commit, react, "hh-back")
    commit(drains.decide, drain, cast["oncall"], "reject", "reseated the riser card; the canary will tell")
    configure(breaker_open_s=60, canary_interval_s=30)

    # A pass: still UNHEALTHY and out of routing; the breaker goes half-open, one trial canary is due at once.
    commit(health.record_canary, node, OK, 12.0)
    node.refresh_from_db()
    assert node.health == Health.UNHEALTHY and node.breaker == BreakerState.HALF_OPEN and weight("hh-back") == 0.0
    half = HealthTransition.objects.filter(node=node, kind=HealthChange.BREAKER).latest("at")
    assert (half.old, half.new) == (BreakerState.CLOSED, BreakerState.HALF_OPEN)
    assert "UNHEALTHY" in half.cause and "trial" in half.cause
    now = time.time()
    assert (node.pk, True) in health.schedule_canaries(now)
    assert all(n != node.pk for n, _ in health.schedule_canaries(now + 1))  # one trial only

    # The trial passes: the breaker closes and the node is HEALTHY, back in routing, each with its row.
    node.refresh_from_db()
    commit(health.record_canary, node, OK, 12.0, trial=True)
    node.refresh_from_db()
    assert node.health == Health.HEALTHY and node.breaker == BreakerState.CLOSED and weight("hh-back") == 1.0
    back = HealthTransition.objects.filter(node=node, kind=HealthChange.HEALTH).latest("at")
    assert (back.old, back.new) == (Health.UNHEALTHY, Health.HEALTHY) and "half-open trial passed" in back.cause
    assert list(
        HealthTransition.objects.filter(node=node, kind=HealthChange.BREAKER)
        .order_by("at")
        .values_list("new", flat=True)
    ) == [BreakerState.HALF_OPEN, BreakerState.CLOSED]
    react()
    assert not Drain.objects.filter(node=node, state=DrainState.PROPOSED).exists()  # the return proposes nothing


@pytest.mark.django_db
def test_a_failed_trial_opens_the_breaker_again_and_the_node_stays_unhealthy(commit, react, tokens, cast):
    node, drain = taken_out_by_xid(commit, react, "hh-again")
    commit(drains.decide, drain, cast["oncall"], "reject", "reseated the riser card; the canary will tell")
    commit(health.record_canary, node, OK, 12.0)
    node.refresh_from_db()
    assert node.breaker == BreakerState.HALF_OPEN
    commit(health.record_canary, node, WRONG, 12.0, trial=True)
    node.refresh_from_db()
    assert node.health == Health.UNHEALTHY and node.breaker == BreakerState.OPEN and weight("hh-again") == 0.0
    assert not HealthTransition.objects.filter(node=node, kind=HealthChange.HEALTH, new=Health.HEALTHY).exists()
    # Open: no canary until the breaker's timeout, then another half-open trial.
    configure(breaker_open_s=60)
    now = time.time()
    assert all(n != node.pk for n, _ in health.schedule_canaries(now + 10))
    assert (node.pk, True) in health.schedule_canaries(now + 61)
