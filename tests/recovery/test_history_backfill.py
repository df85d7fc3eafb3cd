"""The demo's generated history (recovery.actions.history): 30 days of rollups, incidents and level changes, all
marked simulated, counted by the roll-up's own code, written once.

One back-fill for the module (30 days are thousands of rows): written and committed once, read by every test, and
removed at the end. Its traffic is thin (RATE) so it takes seconds; the demo's own rate is HISTORY_RATE_RPS.
"""

import datetime as dt
from collections import Counter

import pytest
from django.db.models import Sum
from django.utils import timezone

from console.readmodels.degradation import degradation_history
from recovery import reactions, tasks
from recovery.actions import capacity, history
from recovery.choices import IncidentStatus, NodeState, Tier
from recovery.models import (
    ApiKey,
    AuditEntry,
    Cluster,
    DegradationChange,
    HistoryBackfill,
    Incident,
    ModelCapacity,
    Node,
    Rack,
    RequestOutcome,
    SloDayCoverage,
    SloDayRollup,
    SloObjective,
    SloRollup,
    SloRollupState,
    key_digest,
)
from recovery.policy import capacity as capacity_policy
from recovery.policy import history as policy
from workers import catalog

pytestmark = pytest.mark.django_db

RATE = 0.02  # requests per second over the three keys: a request a minute or so per tier
MODEL = "Qwen3-32B"


def demo_fleet() -> None:
    """The demo's default fleet as it registers: eight Qwen3-32B nodes at TP 2 (rack-a H100, rack-b H200), one H200
    hot spare in rack-b, a key per tier, and the demo's throughput objective (92% of what the eight carry)."""
    cluster = Cluster.default()
    for i in range(9):
        rack_index = min(i, 7) * 2 // 8  # console/management/commands/demo.py's rule
        rack, _ = Rack.objects.get_or_create(cluster=cluster, name=f"rack-{'ab'[rack_index]}")
        Node.objects.create(
            cluster=cluster,
            rack=rack,
            name=f"node-{i + 1:02d}",
            state=NodeState.SERVING,
            session="s",
            address="http://127.0.0.1:9",
            model_key=MODEL,
            gpu_key=("H100-SXM", "H200-SXM")[rack_index],
            tp=2,
            spare=i == 8,
        )
    for tier in Tier.values:
        tenant = f"demo-{tier.replace('_', '-')}"
        ApiKey.objects.create(tenant=tenant, tier=tier, prefix="llk_test", digest=key_digest(tenant))
    carried = sum(
        capacity_policy.node_capacity(
            catalog.Deployment.of(MODEL, n.gpu_key, n.tp), capacity.slo_of(MODEL, cluster)
        ).rps
        for n in Node.objects.filter(spare=False)
    )
    ModelCapacity.objects.filter(pk=ModelCapacity.of(MODEL, cluster).pk).update(required_rps=round(0.92 * carried, 1))


def remove_everything() -> None:
    rollups = (SloRollup, SloDayRollup, SloDayCoverage, SloRollupState)
    for model in (HistoryBackfill, *rollups, RequestOutcome, Incident, DegradationChange, ApiKey):
        model.objects.all().delete()
    for model in (Node, Rack, SloObjective, AuditEntry, Cluster):
        model.objects.all().delete()


@pytest.fixture(scope="module")
def backfilled(django_db_setup, django_db_blocker):
    with django_db_blocker.unblock():
        demo_fleet()
        until = timezone.now()
        run = history.backfill(until, rate_rps=RATE)
        yield {"run": run, "until": until}
        remove_everything()


def generated(run: HistoryBackfill):
    """Every request the history's generator makes over the window, made again from the run's inputs."""
    made = policy.History(policy.Inputs.from_json(run.inputs))
    start = int(made.inputs.start)
    for t0 in range(start, start + made.inputs.days * policy.DAY_S, 60):
        yield from made.minute(t0)


def test_thirty_days_of_rollups_marked_simulated_ending_where_live_data_begins(backfilled):
    run, until = backfilled["run"], backfilled["until"]
    run.refresh_from_db()
    assert run.finished_at is not None and run.days_done == run.days == 30
    assert run.window_end == until.replace(second=0, microsecond=0)
    assert run.window_start == run.window_end - dt.timedelta(days=30)
    rows = SloRollup.objects.all()
    first, last = rows.order_by("minute").first().minute, rows.order_by("-minute").first().minute
    assert run.window_start <= first < run.window_start + dt.timedelta(minutes=10)
    assert run.window_end - dt.timedelta(minutes=10) < last < run.window_end
    days = {row.minute.date() for row in rows.only("minute")}
    assert len(days) >= 30  # every day of the window (31 calendar dates unless it starts at midnight)
    sums = rows.aggregate(
        valid=Sum("valid"), simulated=Sum("simulated"), client=Sum("client_errors"), gone=Sum("client_gone")
    )
    assert sums["simulated"] == sums["valid"] + sums["client"] + sums["gone"] > 0  # every request is generated
    assert run.summary["requests"] == sums["simulated"]
    # 30 days at RATE: about 52,000 requests.
    assert sums["simulated"] == pytest.approx(30 * 86400 * RATE, rel=0.05)


def test_incidents_at_the_configured_rate_closed_and_marked_simulated(backfilled):
    incidents = list(Incident.objects.all())
    # 4 failures per 1,000 servers a day, raised 30 times, on the demo's eight serving nodes over 30 days: 28.8.
    expected = 8 * 30 * policy.FAULTS_PER_1000_NODE_DAYS / 1000 * policy.ACCELERATION
    assert expected == pytest.approx(28.8)
    assert abs(len(incidents) - expected) < 3 * expected**0.5, len(incidents)  # a Poisson count, seed fixed
    assert len(incidents) == backfilled["run"].summary["incidents"]
    window_start, window_end = backfilled["run"].window_start, backfilled["run"].window_end
    for incident in incidents:
        assert incident.simulated and incident.status == IncidentStatus.CLOSED
        assert window_start <= incident.opened_at < incident.detected_at < incident.recovered_at < window_end
        assert incident.opened_at < incident.capacity_restored_at <= incident.closed_at <= window_end
        assert incident.severity in ("sev1", "sev2", "sev3") and incident.details["severity"]["why"]
        assert incident.nodes.exists()
        assert incident.events.filter(kind="detected").exists() and incident.events.filter(kind="recovered").exists()
    # A switch takes its rack: the SEV1s of the month, with the degradation they caused on their timeline.
    racks = [i for i in incidents if i.details["simulated"]["scope"] == "rack"]
    assert racks and all(i.severity == "sev1" and i.events.filter(kind="degradation").exists() for i in racks)


def test_level_changes_are_simulated_handled_and_never_the_live_level(backfilled):
    changes = DegradationChange.objects.all()
    assert changes.count() == backfilled["run"].summary["degradation_changes"] > 0
    assert all(c.simulated and c.reacted_at is not None and c.model_key == MODEL for c in changes)
    assert max(c.new_level for c in changes) >= 2
    assert [c.new_level for c in changes.order_by("at")][-1] == 0  # the history ends on a whole fleet
    assert reactions.process() == 0  # nothing for recovery.reactions to act on
    assert Cluster.default().state.degradation_level == 0
    assert all(h["simulated"] for h in degradation_history())


def test_shed_only_best_effort_at_level_2_and_above_and_no_token_lost(backfilled):
    rows = SloRollup.objects.all()
    by_tier = {
        row["tier"]: row for row in rows.values("tier").annotate(shed=Sum("shed"), lost=Sum("tokens_lost")).order_by()
    }
    assert by_tier[Tier.BEST_EFFORT]["shed"] > 0
    assert by_tier[Tier.PREMIUM]["shed"] == by_tier[Tier.STANDARD]["shed"] == 0
    assert all(row["lost"] == 0 for row in by_tier.values())
    levels = Counter()
    for shed_by_level in rows.filter(shed__gt=0).values_list("shed_by_level", flat=True):
        levels.update(shed_by_level)
    assert levels and all(int(level) >= 2 for level in levels)
    assert sum(levels.values()) == by_tier[Tier.BEST_EFFORT]["shed"]
    # The shed requests around an incident are kept one by one too, with their 429 and the level.
    kept = RequestOutcome.objects.filter(status="shed")
    assert kept.exists() and all(o.simulated and o.rolled_up for o in kept)
    assert set(kept.values_list("http_status", "tier").distinct()) == {(429, Tier.BEST_EFFORT)}


def test_the_rollups_hold_exactly_what_the_generator_made(backfilled):
    """Made again from the run's inputs and counted here, request by request, without the roll-up's code."""
    owed = {o.tier: o for o in SloObjective.objects.filter(model_key=MODEL, tenant="")}
    counted = {tier: Counter() for tier in Tier.values}
    for o in generated(backfilled["run"]):
        c = counted[o.tier]
        c["valid"] += 1
        c["shed"] += o.status == "shed"
        c["server_errors"] += o.status == "error"
        c["good"] += o.status == "ok"
        c["migrated"] += o.move is not None
        c["completion_tokens"] += o.completion_tokens
        relax = 2 if o.level >= 3 else 1  # level 3 doubles the latency objectives
        if o.ttft_ms is not None:
            c["ttft_valid"] += 1
            c["ttft_good"] += o.ttft_ms <= owed[o.tier].ttft_threshold_ms * relax
        if o.tpot_ms is not None:
            c["tpot_valid"] += 1
            c["tpot_good"] += o.tpot_ms <= owed[o.tier].tpot_threshold_ms * relax
    names = ("valid", "good", "shed", "server_errors", "migrated", "completion_tokens", "ttft_valid", "ttft_good")
    names += ("tpot_valid", "tpot_good")
    stored = SloRollup.objects.values("tier").annotate(**{n: Sum(n) for n in names}).order_by()
    for row in stored:
        assert {n: row[n] for n in names} == {n: counted[row["tier"]][n] for n in names}, row["tier"]
    assert len(stored) == 3 and sum(c["shed"] for c in counted.values()) > 0


def test_a_failure_moves_or_fails_the_requests_on_its_nodes_and_slows_the_rest():
    """The generator alone, at the demo's own traffic (6 req/s) for three days: what a failure does to requests."""
    nodes = tuple(
        policy.NodeSpec(f"n{i}", "rack-a" if i < 4 else "rack-b", MODEL, "H100-SXM", 2, 14.0, spare=i == 8)
        for i in range(9)
    )
    scopes = tuple((f"t-{tier}", tier) for tier in Tier.values)
    made = policy.History(policy.Inputs(7, 1_700_000_040.0, 3, nodes, 0.92 * 8 * 14.0, scopes, MODEL, rate_rps=6.0))
    assert made.faults and not made.faults_in(made.inputs.end - 3600, made.inputs.end)  # all settled before the end
    quiet, moved, failed, slowed = [], [], [], 0
    for fault in made.faults:
        start, end = fault.kept
        for t0 in range(int(start) // 60 * 60, int(end), 60):
            for o in made.minute(t0):
                if o.fault != fault.index:
                    continue
                if o.move:
                    moved.append((fault, o))
                elif o.status == "error":
                    failed.append((fault, o))
                elif o.at < fault.failed_at:
                    quiet.append(o)
                elif fault.detected_at + policy.IN_FLIGHT_S <= o.at < fault.recovered_at and o.status == "ok":
                    slowed += o.ttft_ms > 3 * made.latency.prefill_ms[o.prompt_tokens] + 100
    assert moved and slowed
    for fault, o in moved + failed:  # only around the failure, and only from its nodes
        assert fault.failed_at <= o.at < fault.detected_at + policy.IN_FLIGHT_S
    for fault, o in moved:
        assert o.move["from"] in fault.nodes and o.move["to"] not in fault.nodes
        assert policy.STALL_MS[0] <= o.move["stall_ms"] <= policy.STALL_MS[1] and o.completion_tokens > 0
    assert len(failed) < len(moved)  # a few fail; most are moved
    assert all(o.level == 0 and o.status == "ok" and o.move is None for o in quiet)


def test_running_it_again_adds_nothing(backfilled):
    def counts():
        return (
            SloRollup.objects.aggregate(n=Sum("simulated"))["n"],
            SloRollup.objects.count(),
            Incident.objects.count(),
            DegradationChange.objects.count(),
            RequestOutcome.objects.count(),
            HistoryBackfill.objects.count(),
        )

    before = counts()
    assert history.backfill(timezone.now(), rate_rps=1.0).pk == backfilled["run"].pk
    assert tasks.backfill_history(timezone.now().timestamp()) == "done"  # the demo's task, run again
    assert counts() == before


def test_the_history_ends_where_live_data_begins(backfilled):
    # As if this were the first run, on a database with live traffic from an earlier demo (rolled back at the end).
    HistoryBackfill.objects.all().delete()
    for model in (SloRollup, SloDayRollup, SloDayCoverage):
        model.objects.all().delete()
    live = timezone.now() - dt.timedelta(hours=5, seconds=7)
    RequestOutcome.objects.create(
        request_id="live-1",
        gateway="gw",
        tenant="demo-standard",
        tier=Tier.STANDARD,
        model_key=MODEL,
        status="ok",
        started_at=live,
        finished_at=live,
    )
    run = history.claim(timezone.now(), days=1)
    assert run.window_end == live.replace(second=0, microsecond=0)
    assert run.window_start == run.window_end - dt.timedelta(days=1)


def test_no_fleet_no_history(backfilled):
    HistoryBackfill.objects.all().delete()  # rolled back at the end, as the nodes are
    Node.objects.all().delete()
    assert history.claim(timezone.now()) is None
    assert tasks.backfill_history() == "no fleet yet"
    assert not HistoryBackfill.objects.exists()
