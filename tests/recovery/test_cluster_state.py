"""Issue 44.5: the settings people edit (Cluster) and the state the control plane writes (ClusterState) are apart. The
migration that split them keeps every value a running cluster had, and neither side's write can undo the other's."""

import datetime as dt

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

from recovery.models import Cluster, ClusterState

BEFORE = ("recovery", "0023_reaction_failures_stream_takeovers")
SPLIT = ("recovery", "0024_cluster_state")


@pytest.mark.django_db(transaction=True)
def test_the_split_keeps_every_value_a_cluster_had_and_undoing_it_puts_them_back():
    executor = MigrationExecutor(connection)
    executor.migrate([BEFORE])
    old = executor.loader.project_state([BEFORE]).apps.get_model("recovery", "Cluster")
    started, changed = timezone.now() - dt.timedelta(minutes=5), timezone.now() - dt.timedelta(minutes=2)
    live = {
        "degradation_level": 3,
        "degradation_changed_at": changed,
        "auto_cordon_breaker_open": True,
        "auto_cordon_breaker_changed_at": changed,
        "auto_cordon_breaker_reason": "4 automatic cordons in 600 s",
        "control_plane_started_at": started,
    }
    old.objects.create(name="split-test", tau_tokens=300, breaker_threshold=5, **live)

    executor = MigrationExecutor(connection)
    executor.migrate([SPLIT])
    apps = executor.loader.project_state([SPLIT]).apps
    cluster = apps.get_model("recovery", "Cluster").objects.get(name="split-test")
    state = apps.get_model("recovery", "ClusterState").objects.get(cluster=cluster)
    assert {f: getattr(state, f) for f in live} == live
    assert (cluster.tau_tokens, cluster.breaker_threshold) == (300, 5)  # the settings stay where they were

    executor = MigrationExecutor(connection)
    executor.migrate([BEFORE])  # and back: the columns filled again from the state
    back = executor.loader.project_state([BEFORE]).apps.get_model("recovery", "Cluster").objects.get(name="split-test")
    assert {f: getattr(back, f) for f in live} == live
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())


@pytest.mark.django_db
def test_a_settings_save_and_the_control_planes_writes_never_touch_each_others_columns():
    cluster = Cluster.default()
    stale = Cluster.objects.get(pk=cluster.pk)  # a settings page read the row
    ClusterState.objects.filter(cluster=cluster).update(degradation_level=2, auto_cordon_breaker_open=True)
    stale.tau_tokens = 640
    stale.save()  # a whole-row save of the settings, as the admin does
    cluster.refresh_from_db()
    assert cluster.tau_tokens == 640
    assert (cluster.state.degradation_level, cluster.state.auto_cordon_breaker_open) == (2, True)
    assert not {f.name for f in Cluster._meta.concrete_fields} & {
        f.name for f in ClusterState._meta.concrete_fields if f.name != "cluster"
    }
