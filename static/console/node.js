// The node page: canary and telemetry charts, redrawn when the page's live section refreshes.
(function () {
  "use strict";
  const section = document.getElementById("node-health");
  const canaryEl = document.getElementById("canary-chart");
  const telemetryEl = document.getElementById("telemetry-chart");
  if (!section || !canaryEl) return;
  const base = { paper_bgcolor: "#161b22", plot_bgcolor: "#161b22", font: { color: "#e6edf3", size: 11 },
                 margin: { l: 50, r: 50, t: 10, b: 40 }, height: 260, showlegend: true, legend: { orientation: "h" } };
  const dates = (xs) => xs.map((s) => new Date(s * 1000));

  function draw(data) {
    if (!window.Plotly) return;
    const c = data.canaries;
    Plotly.react(canaryEl, [
      { x: dates(c.t), y: c.latency_ms, name: "latency (ms)", mode: "markers",
        marker: { size: 7, color: c.passed.map((p) => (p ? "#3fb950" : "#f85149")) }, text: c.kind },
      { x: dates(c.t), y: c.baseline_ms, name: "moving baseline", mode: "lines", line: { color: "#8b949e", dash: "dot" } },
    ], { ...base, xaxis: { gridcolor: "#2a323d" }, yaxis: { title: "ms", gridcolor: "#2a323d" } }, { displayModeBar: false, responsive: true });
    const traces = [];
    for (const [gpu, s] of Object.entries(data.telemetry.gpus)) {
      traces.push({ x: dates(s.t), y: s.utilization_pct, name: "GPU " + gpu + " util %", mode: "lines" });
      traces.push({ x: dates(s.t), y: s.temperature_c, name: "GPU " + gpu + " °C", mode: "lines", yaxis: "y2", line: { dash: "dot" } });
    }
    Plotly.react(telemetryEl, traces, { ...base, xaxis: { gridcolor: "#2a323d" }, yaxis: { title: "util %", range: [0, 100], gridcolor: "#2a323d" },
      yaxis2: { title: "°C", overlaying: "y", side: "right", showgrid: false } }, { displayModeBar: false, responsive: true });
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
