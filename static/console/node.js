// The node page: canary and telemetry charts, redrawn when the page's live section refreshes.
(function () {
  "use strict";
  const section = document.getElementById("node-health");
  const canaryEl = document.getElementById("canary-chart");
  const telemetryEl = document.getElementById("telemetry-chart");
  if (!section || !canaryEl) return;
  const base = { paper_bgcolor: "#161b22", plot_bgcolor: "#161b22", font: { color: "#e6edf3", size: 11 },
                 margin: { l: 50, r: 50, t: 10, b: 40 }, height: 300, showlegend: true,
                 legend: { orientation: "h", y: -0.3, yanchor: "top" } };  // below the axis title, never over it
  const axis = (extra) => LifelineTime.axis({ gridcolor: "#2a323d", title: { text: "time (UTC)", standoff: 2 }, ...extra });
  const dates = LifelineTime.plotXs;  // UTC, as every time in the console
  // Fixed axis ranges, widened only by a figure outside them: a change of 0.1 °C or of a millisecond is drawn
  // as the small change it is, never as a full-height spike of an axis fitted to the data.
  const TEMPERATURE_C = [20, 100];
  const MIN_LATENCY_SPAN_MS = 50;
  function span(values, [low, high]) {
    const known = values.filter((v) => v !== null && v !== undefined);
    return [Math.min(low, ...known), Math.max(high, ...known)];
  }

  function draw(data) {
    if (!window.Plotly) return;
    const c = data.canaries;
    const headroom = [...c.latency_ms, ...c.baseline_ms].map((v) => (v === null ? null : v * 1.1));
    Plotly.react(canaryEl, [
      { x: dates(c.t), y: c.latency_ms, name: "latency (ms)", mode: "markers",
        marker: { size: 7, color: c.passed.map((p) => (p ? "#3fb950" : "#f85149")) }, text: c.kind },
      { x: dates(c.t), y: c.baseline_ms, name: "baseline for its prompt", mode: "lines", line: { color: "#8b949e", dash: "dot" } },
    ], { ...base, xaxis: axis({ nticks: 4 }),
      yaxis: { title: "ms", gridcolor: "#2a323d", range: span(headroom, [0, MIN_LATENCY_SPAN_MS]) } },
    { displayModeBar: false, responsive: true });
    const traces = [];
    const temperatures = [];
    for (const [gpu, s] of Object.entries(data.telemetry.gpus)) {
      temperatures.push(...s.temperature_c);
      traces.push({ x: dates(s.t), y: s.utilization_pct, name: "GPU " + gpu + " util %", mode: "lines" });
      traces.push({ x: dates(s.t), y: s.temperature_c, name: "GPU " + gpu + " °C", mode: "lines", yaxis: "y2", line: { dash: "dot" } });
    }
    Plotly.react(telemetryEl, traces, { ...base, xaxis: axis(), yaxis: { title: "util %", range: [0, 100], gridcolor: "#2a323d" },
      yaxis2: { title: "°C", overlaying: "y", side: "right", showgrid: false, range: span(temperatures, TEMPERATURE_C) } },
    { displayModeBar: false, responsive: true });
  }

  async function refresh() {
    const response = await fetch(section.dataset.chartsUrl, { credentials: "same-origin" });
    if (response.ok) draw(await response.json());
  }

  window.addEventListener("load", () => {
    draw(JSON.parse(document.getElementById("chart-data").textContent));
    setInterval(refresh, 5000);  // telemetry arrives with every heartbeat; canaries push a refresh of the section
  });
})();
