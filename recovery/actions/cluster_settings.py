"""The cluster's operating settings: changed here, whatever the door, validated, audited, published.

Only the columns that changed are written, with a conditional update: the
same row carries the degradation level and the cluster breaker, which the
control plane moves every few seconds, and a settings form saved whole would
write back the values it read (a lost update).
"""

from django.db import transaction

from recovery.actions import audit, routing
from recovery.forms import SettingsForm
from recovery.models import Cluster

FIELDS = tuple(SettingsForm.Meta.fields)


class SettingsRefused(ValueError):
    """A value is out of range or malformed; `errors` maps each bad field to why."""

    def __init__(self, errors: dict[str, str]):
        self.errors = errors
        self.field = next(iter(errors))
        super().__init__("; ".join(errors.values()))


def current(cluster: Cluster) -> dict:
    return {name: getattr(cluster, name) for name in FIELDS}


def update(cluster: Cluster, values: dict, actor: str, reason: str = "") -> dict[str, list]:
    """Set some settings: {field: value}, any not given keep theirs. Returns {field: [old, new]} of what changed."""
    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        raise SettingsRefused(
            {unknown[0]: f"{unknown[0]}: not a setting; the settings are {', '.join(sorted(FIELDS))}"}
        )
    with transaction.atomic():
        row = Cluster.objects.select_for_update().get(pk=cluster.pk)
        form = SettingsForm({**current(row), **values}, instance=Cluster(pk=row.pk))
        if not form.is_valid():
            raise SettingsRefused({name: " ".join(errors) for name, errors in form.errors.items()})
        changed = {
            name: [getattr(row, name), form.cleaned_data[name]]
            for name in FIELDS
            if getattr(row, name) != form.cleaned_data[name]
        }
        if changed:
            Cluster.objects.filter(pk=row.pk).update(**{name: new for name, (_, new) in changed.items()})
            audit.record(actor, "settings", f"cluster:{row.name}", reason, changed=changed)
            transaction.on_commit(routing.publish_cluster_config)
    for name, (_, new) in changed.items():
        setattr(cluster, name, new)
    return changed
