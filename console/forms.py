"""Forms: validation only (the actions do the work). Every bad value names its field and the range it must be in."""

from django import forms

from recovery.choices import DrainMode, Remediation


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
