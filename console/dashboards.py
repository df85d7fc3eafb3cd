"""Grafana dashboards for a fleet Lifeline runs, generated from code (grafanalib) into provisioning JSON
(`python manage.py dashboards` writes prometheus/grafana/dashboards/; `--check` says whether they are current).

Every panel reads what Prometheus scrapes with prometheus/server/prometheus.yml: the control plane's /metrics
(job lifeline-control-plane), the gateways' (lifeline-gateway), the nodes' agents (lifeline-node: vLLM's and DCGM's
names beside Lifeline's), and the recording rules of prometheus/slo.yml. The operations e2e runs every panel's query
against a real Prometheus scraping a stack and requires series from each. What Prometheus cannot show (an
incident's timeline, each move of a request, approvals) stays on Lifeline's console; each dashboard links to it.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from grafanalib._gen import DashboardEncoder
from grafanalib.core import (
    GRAPH_TOOLTIP_MODE_SHARED_CROSSHAIR,
    Dashboard,
    DashboardLink,
    GridPos,
    RowPanel,
    Target,
    Template,
    Templating,
    Time,
    TimeSeries,
)

DATASOURCE = "${datasource}"
MODEL = 'model=~"$model"'
RATE = "$__rate_interval"
FOLDER = Path(__file__).resolve().parent.parent / "prometheus" / "grafana" / "dashboards"


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    queries: tuple[tuple[str, str], ...]  # (PromQL, legend)
    unit: str = "short"


def _dashboard(uid: str, title: str, description: str, rows: list[tuple[str, list[Panel]]]) -> Dashboard:
    panels, y = [], 0
    for row_title, row in rows:
        panels.append(RowPanel(title=row_title, gridPos=GridPos(h=1, w=24, x=0, y=y)))
        y += 1
        for i, panel in enumerate(row):
            targets = [
                Target(expr=expr, legendFormat=legend, refId=chr(ord("A") + n), datasource=DATASOURCE)
                for n, (expr, legend) in enumerate(panel.queries)
            ]
            panels.append(
                TimeSeries(
                    title=panel.title,
                    description=panel.description,
                    dataSource=DATASOURCE,
                    targets=targets,
                    unit=panel.unit,
                    gridPos=GridPos(h=8, w=12, x=12 * (i % 2), y=y + 8 * (i // 2)),
                )
            )
        y += 8 * ((len(row) + 1) // 2)
    templating = Templating(
        list=[
            Template(name="datasource", query="prometheus", type="datasource", label="Prometheus"),
            Template(
                name="model",
                query="label_values(lifeline_model_serving_nodes, model)",
                dataSource=DATASOURCE,
                label="Model",
                includeAll=True,
                multi=True,
                allValue=".*",
                default="$__all",
            ),
        ]
    )
    return Dashboard(
        title=title,
        uid=uid,
        description=description,
        tags=["lifeline"],
        panels=panels,
        templating=templating,
        time=Time("now-6h", "now"),
        refresh="30s",
        timezone="utc",
        graphTooltip=GRAPH_TOOLTIP_MODE_SHARED_CROSSHAIR,
        links=[DashboardLink(title="Lifeline dashboards", type="dashboards", tags=["lifeline"], asDropdown=True)],
    ).auto_panel_ids()


def fleet() -> Dashboard:
    return _dashboard(
        "lifeline-fleet",
        "Lifeline / Fleet",
        "Nodes, their health and routing, capacity and degradation, and the GPUs under them.",
        [
            (
                "Serving",
                [
                    Panel(
                        "Nodes serving each model",
                        "Nodes with a routing weight above 0; 0: nobody serves the model (LifelineModelNotServed).",
                        (("lifeline_model_serving_nodes{" + MODEL + "}", "{{model}}"),),
                    ),
                    Panel(
                        "Targets up",
                        "Processes Prometheus scraped, by job: control plane, gateways, nodes.",
                        (('sum by (job) (up{job=~"lifeline-.+"})', "{{job}}"),),
                    ),
                    Panel(
                        "Node health",
                        "0 healthy, 1 suspicious, 2 unhealthy, 3 draining, 4 dead (down or left).",
                        (("lifeline_worker_status{" + MODEL + "}", "{{node}}"),),
                    ),
                    Panel(
                        "Routing weight",
                        "The weight every gateway applies to each node; a spare stands at 0 until promoted.",
                        (("lifeline_routing_weight", "{{node}}"),),
                    ),
                ],
            ),
            (
                "Capacity",
                [
                    Panel(
                        "Degradation level",
                        "0 to 4; at 2 best effort is shed, at 4 no new request is taken.",
                        (("lifeline_degradation_level{" + MODEL + "}", "{{model}}"),),
                    ),
                    Panel(
                        "Capacity over what is asked",
                        "What the nodes in service carry within their objectives, over the required throughput.",
                        (("lifeline_capacity_ratio{" + MODEL + "}", "{{model}}"),),
                        unit="percentunit",
                    ),
                    Panel(
                        "Circuit breakers",
                        "0 closed, 1 open, 2 half-open, per node.",
                        (("lifeline_circuit_breaker_state", "{{node}}"),),
                    ),
                    Panel(
                        "Hot spares",
                        "Nodes kept as hot spares.",
                        (("sum(lifeline_hot_spare)", "spares"),),
                    ),
                ],
            ),
            (
                "GPUs",
                [
                    Panel(
                        "GPU temperature",
                        "DCGM_FI_DEV_GPU_TEMP from each node's agent.",
                        (("DCGM_FI_DEV_GPU_TEMP{" + MODEL + "}", "{{node}} GPU {{gpu}}"),),
                        unit="celsius",
                    ),
                    Panel(
                        "GPU Xid events",
                        "Xid events reported by the nodes, by class (the console's /metrics).",
                        ((f"sum by (class) (increase(lifeline_gpu_xid_events_total[{RATE}]))", "{{class}}"),),
                    ),
                    Panel(
                        "Engine step time",
                        "Each node engine's last step.",
                        (("lifeline_step_seconds{" + MODEL + "}", "{{node}}"),),
                        unit="s",
                    ),
                    Panel(
                        "KV-cache use",
                        "Share of each node's KV-cache blocks in use (vLLM's name).",
                        (("vllm:kv_cache_usage_perc{" + MODEL + "}", "{{node}}"),),
                        unit="percentunit",
                    ),
                ],
            ),
        ],
    )


def gateway() -> Dashboard:
    return _dashboard(
        "lifeline-gateway",
        "Lifeline / Gateway",
        "What clients see: answers by outcome, latency as the client measures it, shedding and load.",
        [
            (
                "Answers",
                [
                    Panel(
                        "Answers per second by outcome",
                        "ok, error, shed (the degradation level's 429/503), rejected (a client's 4xx), client_gone.",
                        (
                            (
                                f"sum by (status) (rate(lifeline_gateway_requests_total{{{MODEL}}}[{RATE}]))",
                                "{{status}}",
                            ),
                        ),
                        unit="reqps",
                    ),
                    Panel(
                        "Shed per second by tier",
                        "Requests the degradation level turned away.",
                        ((f"sum by (tier) (rate(lifeline_gateway_shed_total{{{MODEL}}}[{RATE}]))", "{{tier}}"),),
                        unit="reqps",
                    ),
                    Panel(
                        "In flight",
                        "Requests each gateway relays now.",
                        (("lifeline_gateway_in_flight", "{{instance}}"),),
                    ),
                    Panel(
                        "Node queues",
                        "Running and waiting requests on the nodes (vLLM's names).",
                        (
                            ("sum by (node) (vllm:num_requests_running{" + MODEL + "})", "{{node}} running"),
                            ("sum by (node) (vllm:num_requests_waiting{" + MODEL + "})", "{{node}} waiting"),
                        ),
                    ),
                ],
            ),
            (
                "Latency",
                [
                    Panel(
                        "Time to first token, p50 and p99",
                        "As the client sees it, by tier.",
                        tuple(
                            (
                                f"histogram_quantile({q}, sum by (le, tier) "
                                f"(rate(lifeline_gateway_ttft_seconds_bucket{{{MODEL}}}[{RATE}])))",
                                f"{{{{tier}}}} p{round(q * 100)}",
                            )
                            for q in (0.5, 0.99)
                        ),
                        unit="s",
                    ),
                    Panel(
                        "Time per output token, p50 and p99",
                        "After the first token, as the client sees it, by tier.",
                        tuple(
                            (
                                f"histogram_quantile({q}, sum by (le, tier) "
                                f"(rate(lifeline_gateway_tpot_seconds_bucket{{{MODEL}}}[{RATE}])))",
                                f"{{{{tier}}}} p{round(q * 100)}",
                            )
                            for q in (0.5, 0.99)
                        ),
                        unit="s",
                    ),
                ],
            ),
        ],
    )


def slo() -> Dashboard:
    budget = "(1 - model_tier:lifeline_slo_availability:objective)"
    return _dashboard(
        "lifeline-slo",
        "Lifeline / Objectives and error budgets",
        "The SLIs per model and tier from prometheus/slo.yml's recording rules, and how fast each budget burns "
        "(the page fires at 14.4x over 1h and 5m). The console's /slo/ page has the budgets left and the calendar.",
        [
            (
                "Availability",
                [
                    Panel(
                        "Error ratio, 5m",
                        "Failed or shed over valid requests (ok, error, shed).",
                        (
                            (
                                "model_tier:lifeline_gateway_request_errors:ratio_rate5m{" + MODEL + "}",
                                "{{model}} {{tier}}",
                            ),
                        ),
                        unit="percentunit",
                    ),
                    Panel(
                        "Availability burn rate, 1h and 5m",
                        "The error ratio over the budget (1 - objective); 1 spends the budget in exactly its window.",
                        tuple(
                            (
                                f"model_tier:lifeline_gateway_request_errors:ratio_rate{w}{{{MODEL}}} "
                                f"/ on (model, tier) {budget}",
                                f"{{{{model}}}} {{{{tier}}}} {w}",
                            )
                            for w in ("1h", "5m")
                        ),
                    ),
                    Panel(
                        "Valid requests per second",
                        "What the ratios are of.",
                        (("model_tier:lifeline_gateway_requests_valid:rate5m{" + MODEL + "}", "{{model}} {{tier}}"),),
                        unit="reqps",
                    ),
                ],
            ),
            (
                "Latency objectives",
                [
                    Panel(
                        "Slower than the TTFT objective, 1h",
                        "Share of measured requests over the tier's time-to-first-token threshold.",
                        (("model_tier:lifeline_gateway_ttft_slow:ratio_rate1h{" + MODEL + "}", "{{model}} {{tier}}"),),
                        unit="percentunit",
                    ),
                    Panel(
                        "Slower than the TPOT objective, 1h",
                        "Share of measured requests over the tier's time-per-output-token threshold.",
                        (("model_tier:lifeline_gateway_tpot_slow:ratio_rate1h{" + MODEL + "}", "{{model}} {{tier}}"),),
                        unit="percentunit",
                    ),
                ],
            ),
        ],
    )


def recovery() -> Dashboard:
    return _dashboard(
        "lifeline-recovery",
        "Lifeline / Recovery",
        "Requests moved off failing nodes, what clients waited for it, what was lost (must be 0), and the "
        "checkpoints that make it cheap. Each incident's own timeline and moves are on the console's /incidents/.",
        [
            (
                "Moves",
                [
                    Panel(
                        "Requests moved per second",
                        "By kind (failure, planned) and method (checkpoint restore, live migration, re-prefill).",
                        (
                            (
                                f"sum by (kind, method) (rate(lifeline_migrations_total[{RATE}]))",
                                "{{kind}} {{method}}",
                            ),
                        ),
                        unit="reqps",
                    ),
                    Panel(
                        "Stall around a move, p50 and p99",
                        "Client-visible gap: the last token before the move to the first after.",
                        tuple(
                            (
                                f"histogram_quantile({q}, sum by (le) "
                                f"(rate(lifeline_recovery_stall_seconds_bucket[{RATE}])))",
                                f"p{round(q * 100)}",
                            )
                            for q in (0.5, 0.99)
                        ),
                        unit="s",
                    ),
                    Panel(
                        "Tokens lost",
                        "Tokens a client had received of a stream that then failed: Lifeline's promise is 0.",
                        (("sum(lifeline_tokens_lost_total{" + MODEL + "})", "lost"),),
                    ),
                    Panel(
                        "Drains by state",
                        "Drains the health machine proposed and on-call approved, by state.",
                        (("lifeline_drains", "{{state}}"),),
                    ),
                ],
            ),
            (
                "Checkpoints",
                [
                    Panel(
                        "Checkpoint coverage",
                        "Share of in-flight requests with a usable checkpoint (below 90 % for 5m is a ticket).",
                        (("lifeline_checkpoint_coverage", "coverage"),),
                        unit="percentunit",
                    ),
                    Panel(
                        "Holder balance",
                        "Max over min recovery load across checkpoint holders (goal < 1.5).",
                        (("lifeline_holder_balance", "balance"),),
                    ),
                    Panel(
                        "Checkpoint memory held",
                        "Other nodes' KV pages each node holds in host memory, against its budget.",
                        (
                            ("lifeline_checkpoint_bytes_held{" + MODEL + "}", "{{node}} held"),
                            ("lifeline_checkpoint_budget_bytes{" + MODEL + "}", "{{node}} budget"),
                        ),
                        unit="bytes",
                    ),
                ],
            ),
        ],
    )


def moe() -> Dashboard:
    return _dashboard(
        "lifeline-moe",
        "Lifeline / Mixture of experts",
        "Each decoupled MoE deployment: its expert workers, the experts nobody serves, the routing table in force and "
        "its shadows, and how evenly the experts' work is spread. The console's /moe/ page has the table itself.",
        [
            (
                "Expert workers",
                [
                    Panel(
                        "Expert workers by state",
                        "serving, loading (experts being loaded), standby, suspect (not answering), down, drained.",
                        (
                            (
                                "sum by (deployment, state) (lifeline_moe_expert_workers{" + MODEL + "})",
                                "{{deployment}} {{state}}",
                            ),
                        ),
                    ),
                    Panel(
                        "Experts no serving worker holds",
                        "As primary or shadow: a step that needs one waits for a new table. 0 in a whole deployment.",
                        (("lifeline_moe_experts_unserved{" + MODEL + "}", "{{deployment}}"),),
                    ),
                    Panel(
                        "Tokens through the experts per second",
                        "Summed over the experts, from the workers' own counts.",
                        (
                            (
                                f"sum by (deployment) (rate(lifeline_moe_expert_tokens_total{{{MODEL}}}[{RATE}]))",
                                "{{deployment}}",
                            ),
                        ),
                    ),
                    Panel(
                        "Balancedness",
                        "Mean over max tokens per serving expert worker (vLLM's EPLB measure; 1 is even).",
                        (("lifeline_moe_balancedness{" + MODEL + "}", "{{deployment}}"),),
                    ),
                ],
            ),
            (
                "Routing table",
                [
                    Panel(
                        "Table version",
                        "The expert routing table in force; it steps up at every change the control plane pushes.",
                        (("lifeline_moe_table_version{" + MODEL + "}", "{{deployment}}"),),
                    ),
                    Panel(
                        "Shadow coverage",
                        "Share of the experts with a shadow copy on another worker: what a lost worker fails over to.",
                        (("lifeline_moe_shadow_coverage{" + MODEL + "}", "{{deployment}}"),),
                        unit="percentunit",
                    ),
                ],
            ),
        ],
    )


DASHBOARDS = {"fleet": fleet, "gateway": gateway, "slo": slo, "recovery": recovery, "moe": moe}


def render(dashboard: Dashboard) -> str:
    return json.dumps(dashboard.to_json_data(), cls=DashboardEncoder, indent=2, sort_keys=True) + "\n"


def rendered() -> dict[str, str]:
    """Each dashboard's provisioning JSON by file name."""
    return {f"lifeline-{name}.json": render(make()) for name, make in DASHBOARDS.items()}


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel target in a dashboard's JSON."""
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]
