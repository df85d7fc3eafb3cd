// /reports/: the report's charts, drawn from the figures the server rendered into the page (report-charts-data).
(function () {
  "use strict";
  const source = document.getElementById("report-charts-data");
  if (!source || !window.Plotly) return;
  const charts = JSON.parse(source.textContent);
  const levels = JSON.parse(document.getElementById("report-levels-data").textContent);
  const percent = (values) => values.map((v) => (v === null ? null : 100 * v));
  const base = {
    paper_bgcolor: "#161b22", plot_bgcolor: "#161b22", font: { color: "#e6edf3", size: 11 },
    margin: { l: 60, r: 20, t: 10, b: 50 }, showlegend: true,
    legend: { orientation: "h", x: 0, y: 1.02, yanchor: "bottom" },
  };
  const config = { displayModeBar: false, responsive: true };

  // Days are UTC dates ("2026-01-05"): Plotly draws a date string as written, in no time zone.
  const daily = charts.daily;
  Plotly.newPlot("chart-daily", [
    { x: daily.days, y: percent(daily.availability), name: "availability", mode: "lines+markers", line: { color: "#58a6ff" } },
    { x: daily.days, y: percent(daily.joint_attainment), name: "joint attainment", mode: "lines+markers", line: { color: "#d29922" } },
    { x: daily.days, y: daily.requests, name: "requests", type: "bar", yaxis: "y2", marker: { color: "rgba(139,148,158,0.35)" } },
  ], Object.assign({}, base, {
    height: 300,
    xaxis: { type: "date", title: { text: "day (UTC)" }, gridcolor: "#2a323d" },
    yaxis: { title: { text: "% of valid requests" }, gridcolor: "#2a323d" },
    yaxis2: { title: { text: "requests" }, overlaying: "y", side: "right", showgrid: false },
    margin: { l: 60, r: 60, t: 10, b: 50 },
  }), config);

  // One group of bars per scope, in the table's order; clipped to ±100 % so an overspent budget stays readable.
  const budgets = charts.budgets;
  const clip = (values) => values.map((v) => (v === null ? null : Math.max(-100, Math.min(100, 100 * v))));
  const names = { availability: "availability", ttft: "TTFT", tpot: "TPOT" };
  const colors = { availability: "#58a6ff", ttft: "#3fb950", tpot: "#a371f7" };
  Plotly.newPlot("chart-budgets", Object.keys(names).map((key) => ({
    y: budgets.scopes, x: clip(budgets[key]), name: names[key], type: "bar", orientation: "h",
    marker: { color: colors[key] }, hovertemplate: "%{y}: %{x:.1f}%<extra>" + names[key] + "</extra>",
  })), Object.assign({}, base, {
    height: Math.max(260, 60 + 36 * budgets.scopes.length),
    barmode: "group",
    margin: { l: 220, r: 20, t: 10, b: 50 },
    xaxis: { title: { text: "% of the error budget left (clipped to ±100)" }, range: [-100, 100], gridcolor: "#2a323d", zerolinecolor: "#f85149" },
    yaxis: { autorange: "reversed", automargin: true },
  }), config);

  Plotly.newPlot("chart-degradation", [{
    x: levels.map((l) => "level " + l.level), y: levels.map((l) => l.minutes), type: "bar",
    marker: { color: ["#3fb950", "#d29922", "#d29922", "#f85149", "#f85149"] },
  }], Object.assign({}, base, {
    height: 240, showlegend: false,
    yaxis: { title: { text: "minutes" }, gridcolor: "#2a323d" },
  }), config);
})();
