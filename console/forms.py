"""Forms: validation only (the actions do the work). Every bad value names its field and the range it must be in."""

from django import forms
from django.core.validators import URLValidator

from recovery.actions import notify
from recovery.choices import DrainMode, IncidentSeverity, IncidentStatus, PlacementPolicy, Remediation
from recovery.models import Node
from recovery.policy.placement import POLICIES
from recovery.sim import workload as sim_workload
from workers import faults as fault_kinds


class DrainRequestForm(forms.Form):
    reason = forms.CharField(max_length=2000)
    mode = forms.ChoiceField(choices=DrainMode.choices, initial=DrainMode.IMMEDIATE)
    deadline_s = forms.IntegerField(required=False, min_value=1, max_value=86400)
    # A switch of model is one move of a re-placement (the Placement page), not a drain asked for by hand.
    remediation = forms.ChoiceField(
        choices=[c for c in Remediation.choices if c[0] != Remediation.SWITCH_MODEL], initial=Remediation.RESTART
    )

    def clean(self):
        data = super().clean()
        if data.get("mode") == DrainMode.DEADLINE and not data.get("deadline_s"):
            self.add_error(
                "deadline_s",
                "deadline_s: a deadline drain needs the seconds after the cordon when what is left is migrated",
            )
        return data


def _figure(field_class, name: str, what: str):
    return field_class(required=False, error_messages={"invalid": f"{name}: not a number ({what})"})


class FaultForm(forms.Form):
    """A fault to rehearse on a staging node; the node checks the ranges (workers.faults), this form the types."""

    kind = forms.ChoiceField(choices=[(kind, kind) for kind in fault_kinds.KINDS])
    factor = _figure(forms.FloatField, "factor", "how many times slower, e.g. 3")
    rate = _figure(forms.FloatField, "rate", "the share of requests corrupted, 0 to 1")
    code = _figure(forms.IntegerField, "code", "an Xid code, e.g. 79")
    seconds = _figure(forms.FloatField, "seconds", "how long it lasts")
    target_c = _figure(forms.FloatField, "target_c", "the temperature it heats to, in °C")
    match = forms.CharField(required=False, max_length=2000, strip=False)
    reason = forms.CharField(required=False, max_length=2000)

    NUMBERS = ("factor", "rate", "code", "seconds", "target_c")

    def params(self) -> dict:
        """What the node is sent: the figures given, and for poison the text that fails ("" fails every request)."""
        params = {key: self.cleaned_data[key] for key in self.NUMBERS if self.cleaned_data[key] is not None}
        if self.cleaned_data["kind"] == "poison":
            params["match"] = self.cleaned_data["match"]
        return params


class AuditFilterForm(forms.Form):
    """The audit log's filters, each optional; times in UTC, as every time in the console."""

    actor = forms.CharField(required=False, max_length=150)
    action = forms.ChoiceField(required=False)
    since = forms.DateTimeField(required=False, input_formats=["%Y-%m-%dT%H:%M", "%Y-%m-%d %H:%M", "%Y-%m-%d"])
    until = forms.DateTimeField(required=False, input_formats=["%Y-%m-%dT%H:%M", "%Y-%m-%d %H:%M", "%Y-%m-%d"])

    def __init__(self, data, actions: list[str]):
        super().__init__(data)
        self.fields["action"].choices = [("", "any action")] + [(action, action) for action in actions]

    def clean(self):
        data = super().clean()
        if data.get("since") and data.get("until") and data["since"] > data["until"]:
            self.add_error("until", "until: must be after since")
        return data


UTC_INPUTS = ["%Y-%m-%dT%H:%M", "%Y-%m-%d %H:%M", "%Y-%m-%d"]


def _utc_field(name: str) -> forms.DateTimeField:
    return forms.DateTimeField(
        required=False,
        input_formats=UTC_INPUTS,
        error_messages={"invalid": f"{name}: not a time in UTC (YYYY-MM-DD, or YYYY-MM-DDTHH:MM)"},
    )


def _choice_field(name: str, choices) -> forms.ChoiceField:
    known = ", ".join(value for value, _ in choices)
    return forms.ChoiceField(
        required=False,
        choices=[("", f"any {name}"), *choices],
        error_messages={"invalid_choice": f"{name}: %(value)s is not one of {known}"},
    )


class IncidentFilterForm(forms.Form):
    """The incidents list's filters, each optional: status, severity, a node involved, first symptom from/to (UTC)."""

    status = _choice_field("status", IncidentStatus.choices)
    severity = _choice_field("severity", IncidentSeverity.choices)
    node = forms.CharField(required=False, max_length=63)
    since = _utc_field("since")
    until = _utc_field("until")

    def clean_node(self):
        node = self.cleaned_data["node"].strip()
        if node and not Node.objects.filter(name=node).exists():
            raise forms.ValidationError(f"node: there is no node named {node}")
        return node

    def clean(self):
        data = super().clean()
        if data.get("since") and data.get("until") and data["since"] > data["until"]:
            self.add_error("until", "until: must be after since")
        return data


EXAMPLE_FLEET = """[
  {"name": "a", "count": 4, "model": "Qwen3-32B", "gpu": "H100-SXM", "tp": 2, "rack": "rack-a"},
  {"name": "b", "count": 4, "model": "Qwen3-32B", "gpu": "H200-SXM", "tp": 2, "rack": "rack-b", "spares": 1}
]"""
# Faults the simulator plays out (recovery.sim.faults).
EXPERIMENT_FAULTS = [
    ("", "no failure"),
    ("crash", "crash"),
    ("hang", "hang"),
    ("sdc", "silent corruption (found by canaries)"),
    ("gpu_lost", "GPU lost"),
    ("rack", "rack"),
]


def _number(field_class, name: str, what: str, **kwargs):
    return field_class(
        error_messages={"invalid": f"{name}: not a number ({what})", "required": f"{name}: required ({what})"}, **kwargs
    )


class ExperimentForm(forms.Form):
    """What the Experiments page asks for; the scenario it makes is checked whole by recovery.actions.experiments."""

    name = forms.CharField(required=False, max_length=200)
    fleet_source = forms.ChoiceField(
        choices=[("described", "described below"), ("live", "the live fleet (the registry's nodes)")],
        initial="described",
        widget=forms.RadioSelect,
    )
    fleet_json = forms.CharField(
        required=False,
        strip=False,
        initial=EXAMPLE_FLEET,
        widget=forms.Textarea(attrs={"rows": 6, "spellcheck": "false"}),
    )
    duration_s = _number(forms.FloatField, "duration_s", "seconds of simulated time", initial=60)
    arrival = forms.ChoiceField(choices=[(a, a) for a in sim_workload.ARRIVALS], initial="poisson")
    rate_rps = _number(forms.FloatField, "rate_rps", "requests per second", initial=24)
    cv = _number(forms.FloatField, "cv", "gamma arrivals' coefficient of variation", required=False)
    lengths = forms.ChoiceField(choices=[(k, k) for k in sim_workload.LENGTHS], initial="splitwise-conversation")
    fault_kind = forms.ChoiceField(choices=EXPERIMENT_FAULTS, required=False, initial="crash")
    fault_target = forms.CharField(required=False, max_length=200, initial="b-1")
    fault_at_s = _number(forms.FloatField, "fault_at_s", "seconds after the start", required=False, initial=20)
    fault_repair_s = _number(
        forms.FloatField, "fault_repair_s", "seconds until repaired; empty: never", required=False, initial=30
    )
    objective_percent = _number(
        forms.FloatField,
        "objective_percent",
        "the throughput objective, % of what the fleet carries at the start; empty: no degradation levels",
        required=False,
        min_value=1,
        max_value=200,
    )
    policies = forms.MultipleChoiceField(
        choices=PlacementPolicy.choices,
        initial=list(POLICIES),
        widget=forms.CheckboxSelectMultiple,
        error_messages={"required": "policies: pick at least one"},
    )
    seeds = forms.CharField(initial="1", max_length=200, error_messages={"required": "seeds: at least one, e.g. 1, 2"})

    def clean_seeds(self) -> list[int]:
        text = self.cleaned_data["seeds"]
        try:
            return [int(part) for part in text.replace(",", " ").split()]
        except ValueError:
            raise forms.ValidationError(f"seeds: {text!r} is not a list of whole numbers (e.g. 1, 2, 3)") from None

    def clean(self):
        data = super().clean()
        if data.get("fault_kind") and not data.get("fault_target"):
            self.add_error("fault_target", "fault_target: the node (or, for a rack failure, the rack) that fails")
        if data.get("fault_kind") and data.get("fault_at_s") is None:
            self.add_error("fault_at_s", "fault_at_s: when it fails, in seconds after the start")
        return data

    def workload(self) -> dict:
        data = self.cleaned_data
        workload = {"arrival": data["arrival"], "rate_rps": data["rate_rps"], "lengths": data["lengths"]}
        if data["arrival"] == "gamma" and data["cv"] is not None:
            workload["cv"] = data["cv"]
        return workload

    def degradation(self) -> dict | None:
        """Degradation levels and shedding against a throughput objective (recovery.sim.degradation), or None."""
        percent = self.cleaned_data.get("objective_percent")
        return None if percent is None else {"required_share": percent / 100}

    def fault(self, names: dict[str, str]) -> dict | None:
        """The failure, its target in the simulation's names (a live node's name is translated through `names`)."""
        data = self.cleaned_data
        if not data["fault_kind"]:
            return None
        target = names.get(data["fault_target"], data["fault_target"])
        fault = {"at_s": data["fault_at_s"], "kind": data["fault_kind"], "target": target}
        if data["fault_repair_s"] is not None:
            fault["repair_s"] = data["fault_repair_s"]
        return fault


class NotificationRuleForm(forms.Form):
    """What one on-call engineer is told about and how: e-mail on or off, a webhook of their own, which kinds and
    which incident severities (none ticked: all)."""

    email = forms.BooleanField(required=False, label="E-mail me")
    webhook_url = forms.URLField(
        required=False,
        max_length=500,
        label="My webhook",
        assume_scheme="https",
        widget=forms.URLInput(attrs={"size": 60, "placeholder": "https://hooks.example.com/…"}),
        validators=[URLValidator(schemes=["http", "https"])],
        error_messages={"invalid": "webhook_url: enter an http:// or https:// address"},
    )
    kinds = forms.MultipleChoiceField(
        choices=list(notify.KINDS.items()),
        required=False,
        widget=forms.CheckboxSelectMultiple,
        error_messages={"invalid_choice": "kinds: %(value)s is not a kind of notification"},
    )
    severities = forms.MultipleChoiceField(
        choices=[(s, s.upper()) for s in notify.SEVERITIES],
        required=False,
        widget=forms.CheckboxSelectMultiple,
        error_messages={"invalid_choice": "severities: %(value)s is not a severity (sev1, sev2, sev3)"},
    )
