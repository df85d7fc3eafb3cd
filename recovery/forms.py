"""The cluster's operating settings, validated in one place for every door (the settings page, the JSON API, the
Django admin).

Every bad value names its field and the range it must be in.
"""

from django import forms
from django.core.exceptions import ValidationError

from recovery.models import Cluster, ModelCapacity, SloCorrection, SloObjective
from recovery.policy import slo as slo_policy


def number(value: float) -> str:
    """A bound as a person reads it: 1000000 and 0.5, never 1e+06."""
    return f"{value:.0f}" if float(value).is_integer() else f"{value:g}"


# field -> (least, most, what it is)
RANGES = {
    "canary_interval_s": (5, 3600, "seconds between a node's canaries"),
    "canary_retry_s": (0.5, 600, "seconds before re-checking a node whose canary failed"),
    "canary_timeout_s": (0.1, 60, "seconds a canary may take"),
    "canary_logprob_tolerance": (0.0, 20.0, "nats a top logprob may differ from the golden run"),
    "canary_latency_factor": (1.0, 100.0, "times the moving baseline"),
    "suspicious_after": (1, 20, "consecutive failures"),
    "unhealthy_after": (1, 50, "consecutive failures"),
    "xid_burst_window_s": (0.1, 3600, "seconds"),
    "breaker_threshold": (1, 100, "consecutive failures"),
    "breaker_open_s": (1, 86400, "seconds"),
    "auto_cordon_max_share": (0.01, 1.0, "share of the fleet (0.10 is 10%)"),
    "auto_cordon_window_s": (10, 86400 * 7, "seconds"),
    "degradation_margin": (0.0, 1.0, "share of the ratio"),
    "degradation_hold_s": (0, 86400, "seconds"),
    "tau_tokens": (0, 1_000_000, "tokens"),
    "theta_factor": (1.0, 100.0, "times the mean recovery load"),
    "alpha": (0.0, 100.0, "weight of checkpoint pages in L̂"),
    "beta": (0.0, 100.0, "weight of queue depth in L̂"),
    "stall_timeout_s": (0.5, 600, "seconds"),
    "incident_window_s": (1, 86400, "seconds"),
    "startup_grace_s": (0, 3600, "seconds"),
    "drain_propose_again_s": (10, 86400 * 7, "seconds after a drain was cancelled or rejected"),
}

SETTINGS_GROUPS = (
    (
        "Canaries",
        (
            "canary_interval_s",
            "canary_retry_s",
            "canary_timeout_s",
            "canary_logprob_tolerance",
            "canary_latency_factor",
            "suspicious_after",
            "unhealthy_after",
            "xid_burst_window_s",
        ),
    ),
    ("Circuit breakers", ("breaker_threshold", "breaker_open_s", "auto_cordon_max_share", "auto_cordon_window_s")),
    (
        "Degradation",
        (
            "degradation_margin",
            "degradation_hold_s",
            "startup_grace_s",
        ),
    ),
    (
        "Recovery",
        (
            "placement_policy",
            "tau_tokens",
            "theta_factor",
            "alpha",
            "beta",
            "stall_timeout_s",
            "dispatch_accounting",
            "incident_window_s",
        ),
    ),
    ("On-call", ("oncall_webhook_url", "oncall_emails", "drain_propose_again_s")),
    ("Staging", ("fault_injection_enabled",)),
)


class SettingsForm(forms.ModelForm):
    oncall_webhook_url = forms.URLField(
        label="On-call webhook",
        required=False,
        assume_scheme="https",
        help_text=Cluster._meta.get_field("oncall_webhook_url").help_text,
    )

    class Meta:
        model = Cluster
        fields = [name for _, names in SETTINGS_GROUPS for name in names]
        labels = {
            "xid_burst_window_s": "Xid burst window (s)",
            "auto_cordon_max_share": "Automatic cordons: most of the fleet",
            "auto_cordon_window_s": "Automatic cordons: window (s)",
            "canary_logprob_tolerance": "Top-logprob tolerance",
            # Greek letters as the papers write them: Django would capitalise the first one (τ → Τ, α → Α).
            "tau_tokens": "τ (tokens)",
            "theta_factor": "θ factor",
            "alpha": "α (pages)",
            "beta": "β (queue)",
            "stall_timeout_s": "Stall timeout (s)",
            "incident_window_s": "Incident window (s)",
        }
        help_texts = {
            "stall_timeout_s": "No byte from a node for this long, and its status stream silent or its engine "
            "not stepping: the gateway moves the request (the first token gets the work in front of it on top).",
        }

    def clean(self):
        data = super().clean()
        for name, (low, high, unit) in RANGES.items():
            value = data.get(name)
            if value is not None and not low <= value <= high:
                bounds = f"between {number(low)} and {number(high)} ({unit})"
                self.add_error(name, f"{name} must be {bounds}; got {number(value)}")
        if (
            data.get("suspicious_after")
            and data.get("unhealthy_after")
            and data["unhealthy_after"] < data["suspicious_after"]
        ):
            self.add_error(
                "unhealthy_after",
                "unhealthy_after must be at least suspicious_after: a node is SUSPICIOUS before it is UNHEALTHY",
            )
        emails = [a.strip() for a in (data.get("oncall_emails") or "").split(",") if a.strip()]
        for address in emails:
            try:
                forms.EmailField().clean(address)
            except ValidationError:
                self.add_error("oncall_emails", f"oncall_emails: {address!r} is not an e-mail address")
        return data

    def groups(self):
        return [(title, [self[name] for name in names]) for title, names in SETTINGS_GROUPS]


# A model's capacity objective: field -> (least, most, what it is)
MODEL_RANGES = {
    "required_rps": (0, 1_000_000, "requests per second (0: no objective)"),
    "ttft_ms": (1, 600_000, "milliseconds"),
    "tpot_ms": (0.1, 60_000, "milliseconds"),
    "avg_prompt_tokens": (1, 1_000_000, "tokens"),
    "avg_output_tokens": (1, 1_000_000, "tokens"),
}


class ModelCapacityForm(forms.ModelForm):
    """One model's throughput objective and the latency its capacity is counted within."""

    class Meta:
        model = ModelCapacity
        fields = list(MODEL_RANGES)

    def clean(self):
        data = super().clean()
        for name, (low, high, unit) in MODEL_RANGES.items():
            value = data.get(name)
            if value is not None and not low <= value <= high:
                bounds = f"between {number(low)} and {number(high)} ({unit})"
                self.add_error(name, f"{name} must be {bounds}; got {number(value)}")
        return data


class SloObjectiveForm(forms.ModelForm):
    """An objective's figures: thresholds that are histogram bucket bounds, percentiles and availability in
    (0, 100), a model the catalog knows."""

    class Meta:
        model = SloObjective
        fields = [
            "model_key",
            "tier",
            "tenant",
            "ttft_threshold_ms",
            "ttft_percentile",
            "tpot_threshold_ms",
            "tpot_percentile",
            "availability_target",
            "window",
        ]

    def clean(self):
        data = super().clean()
        for kind in ("ttft", "tpot"):
            value = data.get(f"{kind}_threshold_ms")
            if value is not None:
                try:
                    slo_policy.check_threshold(kind, value)
                except slo_policy.NotABucketBound as exc:
                    self.add_error(f"{kind}_threshold_ms", str(exc))
        for name in ("ttft_percentile", "tpot_percentile", "availability_target"):
            value = data.get(name)
            if value is not None and not 0 < value < 100:
                self.add_error(name, f"{name} must be above 0 and below 100 (a percentage); got {value:g}")
        return data


class SloCorrectionForm(forms.ModelForm):
    """A period excluded from the objectives: it must end after it starts, and say why."""

    class Meta:
        model = SloCorrection
        fields = ["start", "end", "reason", "model_key", "tier"]

    def clean(self):
        data = super().clean()
        if data.get("start") and data.get("end") and data["end"] <= data["start"]:
            self.add_error("end", "end must be after start")
        if not (data.get("reason") or "").strip():
            self.add_error("reason", "reason: say why this period is excluded (it is listed in every report)")
        return data
