"""The cluster's operating settings: changed here, whatever the door, validated, audited, published.

Only the columns that changed are written, with a conditional update: the
same row carries the degradation level and the cluster breaker, which the
control plane moves every few seconds, and a settings form saved whole would
write back the values it read (a lost update).
"""

from django.db import transaction

from recovery.actions import audit, capacity, routing
from recovery.forms import MODEL_RANGES, ModelCapacityForm, SettingsForm
from recovery.models import Cluster, ModelCapacity
from workers import catalog

FIELDS = tuple(SettingsForm.Meta.fields)
MODEL_FIELDS = tuple(MODEL_RANGES)


class SettingsRefused(ValueError):
    """A value is out of range or malformed; `errors` maps each bad field to why."""

    def __init__(self, errors: dict[str, str]):
        self.errors = errors
        self.field = next(iter(errors))
        super().__init__("; ".join(errors.values()))


def current(cluster: Cluster) -> dict:
    """The settings, with each served model's capacity objective under "models"."""
    return {name: getattr(cluster, name) for name in FIELDS} | {"models": current_models(cluster)}


def current_models(cluster: Cluster) -> dict[str, dict]:
    rows = {row.model_key: row for row in ModelCapacity.objects.filter(cluster=cluster)}
    return {
        key: {name: getattr(rows.get(key) or ModelCapacity(model_key=key), name) for name in MODEL_FIELDS}
        for key in capacity.served_models(cluster)
    }


def update(cluster: Cluster, values: dict, actor: str, reason: str = "") -> dict[str, list]:
    """Set some settings: {field: value}, any not given keep theirs, and models' capacity objectives under
    "models": {model: {field: value}}. All or nothing. Returns {field: [old, new]} of what changed (a model's
    fields as "models.<model>.<field>")."""
    values = dict(values)
    per_model = values.pop("models", None) or {}
    if not isinstance(per_model, dict) or not all(isinstance(v, dict) for v in per_model.values()):
        raise SettingsRefused(
            {"models": 'models: give {"<model>": {"<field>": value}}, e.g. {"Qwen3-32B": {"required_rps": 40}}'}
        )
    with transaction.atomic():
        changed = _update_cluster(cluster, values, actor, reason) if values else {}
        for model_key, fields in per_model.items():
            changed |= {
                f"models.{model_key}.{name}": change
                for name, change in update_model(cluster, model_key, fields, actor, reason).items()
            }
    return changed


def update_model(cluster: Cluster, model_key: str, values: dict, actor: str, reason: str = "") -> dict[str, list]:
    """Set some of a model's capacity objective (required throughput, latency within which capacity counts, the
    average request). Returns {field: [old, new]} of what changed."""
    where = f"models.{model_key}"
    if model_key not in catalog.MODELS:
        raise SettingsRefused(
            {where: f"{where}: {model_key!r} is not a catalogued model ({', '.join(catalog.MODELS)})"}
        )
    unknown = sorted(set(values) - set(MODEL_FIELDS))
    if unknown:
        raise SettingsRefused(
            {f"{where}.{unknown[0]}": f"{where}.{unknown[0]}: not a setting; a model has {', '.join(MODEL_FIELDS)}"}
        )
    with transaction.atomic():
        row = ModelCapacity.objects.select_for_update().get(pk=ModelCapacity.of(model_key, cluster).pk)
        present = {name: getattr(row, name) for name in MODEL_FIELDS}
        form = ModelCapacityForm({**present, **values}, instance=ModelCapacity(pk=row.pk))
        if not form.is_valid():
            raise SettingsRefused({f"{where}.{name}": " ".join(errors) for name, errors in form.errors.items()})
        changed = {
            name: [present[name], form.cleaned_data[name]]
            for name in MODEL_FIELDS
            if present[name] != form.cleaned_data[name]
        }
        if changed:
            ModelCapacity.objects.filter(pk=row.pk).update(**{name: new for name, (_, new) in changed.items()})
            audit.record(actor, "settings", f"model:{model_key}", reason, changed=changed)
    return changed


def _update_cluster(cluster: Cluster, values: dict, actor: str, reason: str) -> dict[str, list]:
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
