"""The SLA report's ways out of the console: the CSV (one row per day and scope, with every count a figure is made
of), the PDF (the page's figures and charts, on A4, drawn with reportlab) and the weekly e-mail to managers.

All three read the one dict console.readmodels.reports.report() returns.
"""

import csv
import datetime as dt
import io
import logging
from xml.sax.saxutils import escape

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.mail import EmailMessage, get_connection
from django.utils import timezone
from reportlab.graphics.charts.barcharts import HorizontalBarChart, VerticalBarChart
from reportlab.graphics.charts.legends import Legend
from reportlab.graphics.charts.linecharts import HorizontalLineChart
from reportlab.graphics.shapes import Drawing, String
from reportlab.lib import colors
from reportlab.lib.pagesizes import A4
from reportlab.lib.styles import getSampleStyleSheet
from reportlab.lib.units import mm
from reportlab.platypus import Paragraph, SimpleDocTemplate, Spacer, Table, TableStyle

from console.readmodels import reports
from recovery import roles
from recovery.actions import audit
from recovery.models import AuditEntry
from recovery.policy import slo as slo_policy

log = logging.getLogger(__name__)

PDF_BUDGET_BARS = 40  # the scopes with the least budget left; a tenant breakdown can have hundreds


def filename(data: dict, extension: str) -> str:
    period = data["period"]
    tenants = "-by-tenant" if data["by_tenant"] else ""
    return f"lifeline-sla-{period['start'][:10]}-to-{period['last_day']}{tenants}.{extension}"


# --- CSV ---------------------------------------------------------------------------------------------------------
def _bucket_names(kind: str) -> list[str]:
    bounds = slo_policy.BOUNDS_MS[kind]
    return [f"{kind}_le_{b}ms" for b in bounds] + [f"{kind}_over_{bounds[-1]}ms"]


def csv_header(by_tenant: bool) -> list[str]:
    return [
        "day",
        "model",
        "tier",
        *(["tenant"] if by_tenant else []),
        "availability_target_pct",
        "ttft_percentile",
        "ttft_threshold_ms",
        "tpot_percentile",
        "tpot_threshold_ms",
        *reports.COUNT_FIELDS,
        *_bucket_names("ttft"),
        *_bucket_names("tpot"),
    ]


def report_csv(data: dict) -> str:
    """One row per UTC day and model × tier (× tenant) with the good and valid counts of every indicator, the
    histogram buckets and the objective's targets: every figure of the report can be recomputed from it."""
    objectives = {(r["model"], r["tier"], r["tenant"]): r["objective"] for r in data["rows"]}
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(csv_header(data["by_tenant"]))
    for day in data["daily"]:
        objective = objectives[(day["model"], day["tier"], day["tenant"])]
        writer.writerow(
            [
                day["day"],
                day["model"],
                day["tier"],
                *([day["tenant"]] if data["by_tenant"] else []),
                objective["availability_target"],
                objective["ttft_percentile"],
                objective["ttft_ms"],
                objective["tpot_percentile"],
                objective["tpot_ms"],
                *(day[name] for name in reports.COUNT_FIELDS),
                *day["ttft_hist"],
                *day["tpot_hist"],
            ]
        )
    return out.getvalue()


# --- PDF ---------------------------------------------------------------------------------------------------------
GREEN, AMBER, RED, BLUE, GREY = (colors.HexColor(c) for c in ("#1a7f37", "#9a6700", "#cf222e", "#0969da", "#6e7781"))
BADGE = {"green": GREEN, "amber": AMBER, "red": RED, "grey": GREY}
TABLE_STYLE = TableStyle(
    [
        ("FONT", (0, 0), (-1, -1), "Helvetica", 7),
        ("FONT", (0, 0), (-1, 0), "Helvetica-Bold", 7),
        ("LINEBELOW", (0, 0), (-1, 0), 0.6, colors.black),
        ("LINEBELOW", (0, 1), (-1, -1), 0.2, colors.lightgrey),
        ("VALIGN", (0, 0), (-1, -1), "TOP"),
        ("TOPPADDING", (0, 0), (-1, -1), 1.5),
        ("BOTTOMPADDING", (0, 0), (-1, -1), 1.5),
    ]
)


def _percent(value: float | None) -> float | None:
    return None if value is None else round(100 * value, 3)


def _title(drawing: Drawing, text: str) -> None:
    drawing.add(String(0, drawing.height - 10, text, fontName="Helvetica-Bold", fontSize=9))


def daily_chart(data: dict, width: float) -> Drawing:
    """Availability and joint attainment per UTC day."""
    daily = data["charts"]["daily"]
    series = [[_percent(v) for v in daily["availability"]], [_percent(v) for v in daily["joint_attainment"]]]
    drawing = Drawing(width, 170)
    _title(drawing, "Availability and joint attainment per day (UTC), %")
    chart = HorizontalLineChart()
    chart.x, chart.y, chart.width, chart.height = 40, 30, width - 60, 115
    chart.data = series
    values = [v for s in series for v in s if v is not None]
    low = min(values) if values else 99.0
    chart.valueAxis.valueMin = max(0.0, min(99.0, low) - 0.5)
    chart.valueAxis.valueMax = 100.0
    chart.valueAxis.labels.fontSize = 7
    step = max(1, len(daily["days"]) // 10)
    chart.categoryAxis.categoryNames = [d[5:] if i % step == 0 else "" for i, d in enumerate(daily["days"])]
    chart.categoryAxis.labels.fontSize = 6
    chart.categoryAxis.labels.angle = 30
    chart.categoryAxis.labels.boxAnchor = "ne"
    chart.lines[0].strokeColor, chart.lines[1].strokeColor = BLUE, AMBER
    chart.lines[0].strokeWidth = chart.lines[1].strokeWidth = 1.5
    drawing.add(chart)
    legend = Legend()
    legend.x, legend.y, legend.fontSize = width - 190, drawing.height - 6, 7
    legend.alignment, legend.columnMaximum = "right", 1
    legend.colorNamePairs = [(BLUE, "availability"), (AMBER, "joint attainment")]
    drawing.add(legend)
    return drawing


def budget_chart(data: dict, width: float) -> Drawing:
    """Error budget left per scope (the least of its three objectives), clipped to ±100 %."""
    rows = sorted((r for r in data["rows"] if r["lowest_budget"] is not None), key=lambda r: r["lowest_budget"])
    rows = rows[:PDF_BUDGET_BARS]
    height = 40 + 11 * max(len(rows), 1)
    drawing = Drawing(width, height)
    title = "Error budget left, the least of each scope's three objectives, %"
    _title(drawing, title + (f" (the {PDF_BUDGET_BARS} with least left)" if len(data["rows"]) > len(rows) else ""))
    if not rows:
        drawing.add(String(0, 10, "No data in the period.", fontName="Helvetica", fontSize=8))
        return drawing
    chart = HorizontalBarChart()
    chart.x, chart.y, chart.width, chart.height = 170, 15, width - 190, height - 35
    chart.data = [[max(-100.0, min(100.0, 100 * r["lowest_budget"])) for r in reversed(rows)]]
    chart.categoryAxis.categoryNames = [r["scope"] for r in reversed(rows)]
    chart.categoryAxis.labels.fontSize = 6.5
    chart.categoryAxis.joinAxisMode = "left"  # the names beside the chart, not on the bars left of zero
    chart.valueAxis.valueMin, chart.valueAxis.valueMax, chart.valueAxis.valueStep = -100, 100, 25
    chart.valueAxis.labels.fontSize = 7
    chart.bars[0].fillColor = BLUE
    for i, row in enumerate(reversed(rows)):
        chart.bars[(0, i)].fillColor = BADGE[slo_policy.budget_badge(row["lowest_budget"])]
    drawing.add(chart)
    return drawing


def degradation_chart(data: dict, width: float) -> Drawing:
    levels = data["degradation"]["levels"]
    drawing = Drawing(width, 130)
    _title(drawing, "Minutes at each degradation level")
    chart = VerticalBarChart()
    chart.x, chart.y, chart.width, chart.height = 50, 20, width / 2 - 60, 90
    chart.data = [[level["minutes"] for level in levels]]
    chart.categoryAxis.categoryNames = [f"level {level['level']}" for level in levels]
    chart.categoryAxis.labels.fontSize = 7
    chart.valueAxis.valueMin = 0
    chart.valueAxis.labels.fontSize = 7
    chart.bars[0].fillColor = AMBER
    drawing.add(chart)
    return drawing


def _table(header: list[str], body: list[list], widths: list[float] | None = None, figures_from: int = 1) -> Table:
    """A table in the report's style; the columns from `figures_from` on hold figures, aligned right."""
    table = Table([header, *body], colWidths=widths, repeatRows=1, hAlign="LEFT")
    table.setStyle(TABLE_STYLE)
    if figures_from < len(header):
        table.setStyle(TableStyle([("ALIGN", (figures_from, 0), (-1, -1), "RIGHT")]))
    return table


def _when(iso: str) -> str:
    return iso[:16].replace("T", " ")


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.1f} s"


def report_pdf(data: dict) -> bytes:
    """The report on A4: headline figures, charts, the scope tables, incidents, corrections and completeness."""
    buffer = io.BytesIO()
    doc = SimpleDocTemplate(
        buffer,
        pagesize=A4,
        leftMargin=15 * mm,
        rightMargin=15 * mm,
        topMargin=15 * mm,
        bottomMargin=15 * mm,
        title=f"Lifeline SLA report, {data['period']['label']}",
        author="Lifeline",
    )
    width = doc.width
    styles = getSampleStyleSheet()
    body, small = styles["BodyText"], styles["BodyText"].clone("small", fontSize=7, leading=9)
    story = [
        Paragraph("Lifeline SLA report", styles["Title"]),
        Paragraph(
            escape(
                f"{data['period']['label']}: {_when(data['period']['start'])} to {_when(data['period']['end'])} UTC "
                f"(generated {_when(data['generated_at'])} UTC" + (", per tenant)" if data["by_tenant"] else ")")
            ),
            body,
        ),
        Spacer(1, 4 * mm),
    ]
    if not data["has_data"]:
        story.append(Paragraph("<b>No requests in this period.</b> Nothing here vouches for the service.", body))
    headline = [[name, value] for name, value in reports.headline(data)]
    story.append(_table(["Figure", "Value"], headline, [45 * mm, width - 45 * mm], figures_from=2))
    story.append(Spacer(1, 4 * mm))
    if data["has_data"]:
        story += [daily_chart(data, width), Spacer(1, 3 * mm), budget_chart(data, width), Spacer(1, 3 * mm)]

    scopes = "model, tier and tenant" if data["by_tenant"] else "model and tier"
    story.append(Paragraph(f"Attainment per {scopes}", styles["h3"]))
    rows = data["rows"]
    story.append(
        _table(
            ["Scope", "Requests", "Availability", "TTFT", "TPOT", "Joint", "Goodput", "Change: req.", "avail."],
            [
                [
                    Paragraph(escape(r["scope"]), small),
                    f"{r['requests']:,}",
                    r["availability_text"],
                    r["ttft_attainment_text"],
                    r["tpot_attainment_text"],
                    r["joint_attainment_text"],
                    r["goodput_text"],
                    r["change"]["requests_text"],
                    r["change"]["availability_text"],
                ]
                for r in rows
            ]
            or [["No requests in this period.", "", "", "", "", "", "", "", ""]],
            [42 * mm, 16 * mm, 17 * mm, 17 * mm, 17 * mm, 17 * mm, 18 * mm, 17 * mm, width - 161 * mm],
        )
    )
    story.append(Spacer(1, 3 * mm))
    story.append(Paragraph("Latency percentiles and error budget left", styles["h3"]))
    story.append(
        _table(
            ["Scope", "TTFT p50", "p90", "p99", "TPOT p50", "p90", "p99", "Left: avail.", "TTFT", "TPOT"],
            [
                [
                    Paragraph(escape(r["scope"]), small),
                    r["ttft_p50_text"],
                    r["ttft_p90_text"],
                    r["ttft_p99_text"],
                    r["tpot_p50_text"],
                    r["tpot_p90_text"],
                    r["tpot_p99_text"],
                    *(b["budget_text"] for b in r["budgets"]),
                ]
                for r in rows
            ]
            or [["No requests in this period.", "", "", "", "", "", "", "", "", ""]],
            [42 * mm] + [(width - 42 * mm) / 9] * 9,
        )
    )
    story.append(Spacer(1, 3 * mm))
    story.append(Paragraph("Capacity: degradation and shedding", styles["h3"]))
    story.append(degradation_chart(data, width))
    degradation = data["degradation"]
    story.append(
        _table(
            ["Level", *(str(level["level"]) for level in degradation["levels"]), "Changes"],
            [
                ["Minutes" if len(degradation["by_model"]) < 2 else "Fleet (worst model)"]
                + [f"{level['minutes']:,.1f}" for level in degradation["levels"]]
                + [degradation["changes"]]
            ]
            + [
                [m["model"], *(f"{level['minutes']:,.1f}" for level in m["levels"]), m["changes"]]
                for m in degradation["by_model"]
                if len(degradation["by_model"]) > 1
            ],
        )
    )
    if degradation["relaxed_text"]:
        story.append(Paragraph(escape(degradation["relaxed_text"]), body))
    story.append(Spacer(1, 2 * mm))
    shed = degradation["shed_by_tier"]
    story.append(
        _table(["Tier", *(s["tier_label"] for s in shed)], [["Requests shed", *(f"{s['shed']:,}" for s in shed)]])
        if shed
        else Paragraph("No requests shed.", body)
    )
    migrations = data["migrations"]
    story.append(Spacer(1, 2 * mm))
    story.append(
        Paragraph(
            f"Migrations: <b>{migrations['migrated']:,}</b> requests moved. "
            f"Tokens lost: <b>{migrations['tokens_lost']:,}</b>"
            + (" (as it must be)." if migrations["tokens_lost"] == 0 else ": every one is a defect."),
            body,
        )
    )

    story.append(Paragraph("Incidents", styles["h3"]))
    story.append(
        _table(
            [
                "#",
                "Opened (UTC)",
                "Severity",
                "Cause",
                "Detect",
                "Latency back",
                "Capacity back",
                "Failed",
                "Shed",
                "Moved",
                "Longest stall",
                "Budget used",
            ],
            [
                [
                    str(i["id"]),
                    _when(i["opened_at"]),
                    i["severity_label"],
                    Paragraph(escape(i["cause"]) + (" (simulated)" if i["simulated"] else ""), small),
                    _seconds(i["detect_s"]),
                    _seconds(i["latency_s"]),
                    _seconds(i["capacity_s"]),
                    f"{i['failed']:,}",
                    f"{i['shed']:,}",
                    f"{i['moved']:,}",
                    "n/a" if i["longest_stall_ms"] is None else f"{i['longest_stall_ms']:,.0f} ms",
                    i["budget_consumed_text"],
                ]
                for i in data["incidents"]
            ]
            or [["", "No incident in this period.", "", "", "", "", "", "", "", "", "", ""]],
            [
                8 * mm,
                26 * mm,
                12 * mm,
                width - 164 * mm,
                13 * mm,
                15 * mm,
                16 * mm,
                13 * mm,
                13 * mm,
                13 * mm,
                19 * mm,
                16 * mm,
            ],
            figures_from=4,
        )
    )
    story.append(Paragraph("Corrections (periods excluded from the figures)", styles["h3"]))
    story.append(
        _table(
            ["From (UTC)", "To (UTC)", "Scope", "Why", "By"],
            [
                [
                    _when(c["start"]),
                    _when(c["end"]),
                    c["scope"],
                    Paragraph(escape(c["reason"]), small),
                    c["by"],
                ]
                for c in data["corrections"]
            ]
            or [["", "No correction in this period.", "", "", ""]],
            [26 * mm, 26 * mm, 40 * mm, width - 117 * mm, 25 * mm],
            figures_from=5,
        )
    )
    completeness = data["completeness"]
    story.append(Paragraph("Data completeness", styles["h3"]))
    story.append(
        Paragraph(escape(f"{completeness['text']}; {completeness['simulated_text']}."), body),
    )
    doc.build(story)
    return buffer.getvalue()


# --- the weekly e-mail -------------------------------------------------------------------------------------------
def manager_emails() -> list[str]:
    users = get_user_model().objects.filter(groups__name=roles.MANAGER, is_active=True).exclude(email="")
    return sorted(set(users.values_list("email", flat=True)))


def mail_report(period: reports.Period, now: dt.datetime | None = None) -> list[str]:
    """E-mail the period's report to every manager with an address: the headline figures in the body, the PDF
    attached, one message each. Once per period: a second run for the same period sends nothing. Returns the
    addresses written to."""
    now = now or timezone.now()
    target = f"sla-report:{period.kind}:{period.start.date()}"
    if AuditEntry.objects.filter(action="sla_report_mailed", target=target).exists():
        return []
    to = manager_emails()
    if not to:
        log.info("SLA report for %s: no manager has an e-mail address", period.label)
        return []
    data = reports.report(period, now=now)
    pdf = report_pdf(data)
    link = f"{settings.LIFELINE_CONSOLE_URL}/reports/?period={period.kind}"
    lines = [f"{name}: {value}" for name, value in reports.headline(data)]
    if not data["has_data"]:
        lines.insert(0, "No requests in this period: nothing here vouches for the service.")
    body = "\n".join([f"Lifeline SLA report, {period.label}", "", *lines, "", f"The full report: {link}", ""])
    messages = []
    for address in to:
        message = EmailMessage(f"[Lifeline] SLA report, {period.label}", body, settings.DEFAULT_FROM_EMAIL, [address])
        message.attach(filename(data, "pdf"), pdf, "application/pdf")
        messages.append(message)
    get_connection().send_messages(messages)
    audit.record("system", "sla_report_mailed", target, f"weekly SLA report, {period.label}", to=to)
    return to
