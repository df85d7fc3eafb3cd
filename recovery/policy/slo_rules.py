"""The objectives as Prometheus recording rules (prometheus/objectives.yml), written from the objectives of record.

Pure: the caller passes each model and tier's figures (the console's objectives, or the shipped defaults). A tier's
targets are a large model's defaults (recovery.policy.slo.default_for); a model whose objective differs gets an
override with a `model` label. `manage.py slo_rules` writes the file from the database, so an admin's edit on the
console reaches Prometheus' burn-rate alerts; the file in the repository is this function over the defaults (a test
holds them equal).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from recovery.policy import slo

TIERS = ("premium", "standard", "best_effort")
KINDS = ("availability", "ttft", "tpot")


@dataclass(frozen=True)
class Objective:
    model: str
    tier: str
    availability: float  # percent
    ttft_ms: int
    ttft_percentile: float
    tpot_ms: int
    tpot_percentile: float

    def target(self, kind: str) -> tuple[float, str | None]:
        """(share of requests, the `le` bucket bound in seconds as the gateway writes it, or None)."""
        if kind == "availability":
            return self.availability / 100, None
        if kind == "ttft":
            return self.ttft_percentile / 100, str(self.ttft_ms / 1000)
        return self.tpot_percentile / 100, str(self.tpot_ms / 1000)


def default(model: str, tier: str) -> Objective:
    d = slo.default_for(model, tier)
    return Objective(model, tier, d.availability, d.ttft_ms, d.ttft_percentile, d.tpot_ms, d.tpot_percentile)


HEADER = """\
# Lifeline's service-level objectives, for the rules in slo.yml: the one place to change a target.
#
# Written by `manage.py slo_rules` from the console's objectives (this copy: the shipped defaults); regenerate it
# after an objective is edited, rather than editing it by hand.
#
# Each objective is a recording rule holding a constant. Per tier (premium, standard, best_effort):
#   tier:lifeline_slo_availability:objective   share of valid requests answered without a server-side failure
#   tier:lifeline_slo_ttft:objective{le=…}     share of requests whose time to first token is at most `le` seconds
#   tier:lifeline_slo_tpot:objective{le=…}     share of requests whose time per output token is at most `le` seconds
# and, for a model whose targets differ from its tier's, an override with a `model` label. The rules below
# them combine the two into model_tier:…:objective for every model and tier the gateways have answered.
#
# `le` must be a bucket bound of the gateways' latency histograms (recovery.policy.slo.TTFT_BOUNDS_MS and
# TPOT_BOUNDS_MS, in seconds, written as the gateway writes them: "2.0", "0.45"); a threshold between two
# bounds selects no bucket and the objective reads as "no data".
#
# The tiers' targets are the console's defaults for a large model (recovery.policy.slo.default_for): MLPerf
# Inference's latency constraints, p99 TTFT / p99 TPOT, Llama-2-70B server 2,000 / 200 ms (standard) and
# interactive 450 / 40 ms (premium); best effort keeps the server thresholds at p90.
groups:
  - name: lifeline-slo-objectives
    rules:
"""

COMBINE = """
      # --- the burn-rate alerts' minimum-traffic guard ---------------------------------------------------
      # A page rule whose long window (1 h, 6 h) saw fewer valid requests than this does not page: a handful
      # of errors at night is a large share of very little traffic (recovery.policy.slo.MIN_VALID_FOR_PAGE).
      - record: cluster:lifeline_slo_min_valid_for_page:count
        expr: vector({min_valid})

      # --- every model and tier the gateways answered, with its objective (override, else its tier's) -----
"""

COMBINED = """\
      - record: model_tier:lifeline_slo_{kind}:objective
        expr: |
          model_tier:lifeline_slo_{kind}_override:objective
          or on (model, tier)
          (
            group by (model, tier) (lifeline_gateway_requests_total{{model!="none"}})
            * on (tier) group_left ({keep}) tier:lifeline_slo_{kind}:objective
          )
"""


def _section(title: str) -> str:
    return f"      # --- {title} ".ljust(110, "-") + "\n"


def _rule(record: str, share: float, labels: dict[str, str]) -> str:
    shown = ", ".join(f'{k}: "{v}"' if k == "le" else f"{k}: {v}" for k, v in labels.items())
    return f"      - record: {record}\n        expr: vector({share:g})\n        labels: {{{shown}}}\n"


def objectives_file(objectives: Iterable[Objective], base_model: str = "Qwen3-32B") -> str:
    """The rule file for these objectives (one per model and tier; a tier without one reads its tier's)."""
    text = HEADER + _section("per tier: a large model's targets")
    bases = {tier: default(base_model, tier) for tier in TIERS}
    for kind in KINDS:
        for tier in TIERS:
            share, le = bases[tier].target(kind)
            text += _rule(f"tier:lifeline_slo_{kind}:objective", share, {"tier": tier, **({"le": le} if le else {})})
    overrides = ""
    chosen = sorted(objectives, key=lambda o: (o.model, TIERS.index(o.tier) if o.tier in TIERS else len(TIERS)))
    for kind in KINDS:
        for o in chosen:
            base = bases.get(o.tier)
            share, le = o.target(kind)
            if base is not None and base.target(kind) == (share, le):
                continue
            labels = {"model": o.model, "tier": o.tier, **({"le": le} if le else {})}
            overrides += _rule(f"model_tier:lifeline_slo_{kind}_override:objective", share, labels)
    if overrides:
        text += "\n" + _section("per model, where it differs from its tier") + overrides
    text += COMBINE.format(min_valid=slo.MIN_VALID_FOR_PAGE)
    text += "".join(COMBINED.format(kind=kind, keep="" if kind == "availability" else "le") for kind in KINDS)
    return text
