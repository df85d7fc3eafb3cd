"""Forms: validation only (the actions do the work). Every bad value names its field and the range it must be in."""

from django import forms

from recovery.choices import DrainMode, IncidentSeverity, IncidentStatus, Remediation
from recovery.models import Node
from workers import faults as fault_kinds


class DrainRequestForm(forms.Form):
    reason = forms.CharField(max_length=2000)
    mode = forms.ChoiceField(choices=DrainMode.choices, initial=DrainMode.IMMEDIATE)
    deadline_s = forms.IntegerField(required=False, min_value=1, max_value=86400)
    remediation = forms.ChoiceField(choices=Remediation.choices, initial=Remediation.RESTART)

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
