// One objective's page: its live parts refreshed from the server's own fragment every 15 s (rollups move each
// minute) and swapped in by id; the burn-down and percentile-band charts redrawn from the data the fragment carries.
(function () {
  "use strict";
  const root = document.getElementById("slo-detail");
  if (!root) return;
  const time = window.LifelineTime;  // UTC, as every time in the console
  const options = { displayModeBar: false, responsive: true };
  const colors = { availability: "#58a6ff", ttft: "#3fb950", tpot: "#d29922" };
  const layout = (title, xaxis, yaxis, extra) => ({
    paper_bgcolor: "#161b22", plot_bgcolor: "#161b22", font: { color: "#e6edf3", size: 11 },
    margin: { l: 55, r: 15, t: 30, b: 45 }, showlegend: true,
    legend: { orientation: "h", y: -0.3, yanchor: "top" },
    title: { text: title, font: { size: 12 }, x: 0.01 },
    xaxis: time.axis({ gridcolor: "#2a323d", ...xaxis }),
    yaxis: { gridcolor: "#2a323d", ...yaxis },
    ...extra,
  });
  const noData = (shown) => (shown ? [] : [{ text: "no data in the window", showarrow: false, xref: "paper",
    yref: "paper", x: 0.5, y: 0.5, font: { color: "#8b949e", size: 13 } }]);

  function drawBurnDown(burn) {
    const traces = [];
    let lowest = 0;
    for (const [key, s] of Object.entries(burn.indicators)) {
      if (!s.t.length) continue;
      const y = s.remaining.map((v) => v * 100);
      lowest = Math.min(lowest, ...y);
      traces.push({ x: time.plotXs(s.t), y, name: s.name, mode: "lines+markers", line: { shape: "hv", color: colors[key] },
        marker: { size: 4 } });
    }
    const shown = traces.length > 0;
    traces.push({ x: time.plotXs(burn.ideal.t), y: burn.ideal.remaining.map((v) => v * 100), name: "ideal: spent evenly",
      mode: "lines", line: { dash: "dot", color: "#8b949e" } });
    Plotly.react("chart-burn-down", traces, layout("error budget left (%)", {},
      { title: { text: "% of the budget" }, range: [Math.min(lowest * 1.1, -5), 105] },
      { height: 300, annotations: noData(shown) }), options);
  }

  function drawBands(kind, label, b) {
    const x = b.days;
    const line = (y, name, color, fill) => ({ x, y, name, mode: "lines+markers", line: { color }, marker: { size: 5 },
      connectgaps: false, ...(fill ? { fill: "tonexty", fillcolor: fill } : {}) });
    const traces = [
      line(b.p50, "p50", "#58a6ff"),
      line(b.p90, "p90", "#bc8cff", "rgba(88,166,255,.12)"),
      line(b.p99, "p99", "#f778ba", "rgba(188,140,255,.12)"),
    ];
    const highest = Math.max(b.threshold_ms, ...b.p99.filter((v) => v !== null));
    const threshold = { type: "line", xref: "paper", x0: 0, x1: 1, y0: b.threshold_ms, y1: b.threshold_ms,
      line: { color: "#f85149", dash: "dash", width: 1.5 } };
    const annotations = [{ text: "threshold " + b.threshold_ms.toLocaleString("en-US") + " ms (p" + b.percentile + ")", showarrow: false,
      xref: "paper", x: 1, xanchor: "right", y: b.threshold_ms, yanchor: "bottom", font: { color: "#f85149", size: 11 } },
      ...noData(x.length > 0)];
    Plotly.react("chart-" + kind + "-bands", traces, layout(label + " (ms) per day: p50, p90, p99",
      { title: { text: "day (UTC)" } }, { title: { text: "ms" }, range: [0, highest * 1.15] },
      { height: 280, shapes: [threshold], annotations }), options);
  }

  function draw() {
    if (!window.Plotly || !time) return;
    const data = JSON.parse(document.getElementById("slo-chart-data").textContent);
    drawBurnDown(data.burn_down);
    drawBands("ttft", "TTFT", data.bands.ttft);
    drawBands("tpot", "TPOT", data.bands.tpot);
  }

  async function refresh() {
    try {
      const response = await fetch(root.dataset.refreshUrl, { headers: { "X-Requested-With": "fetch" }, credentials: "same-origin" });
      if (!response.ok) return;
      const fresh = document.createElement("template");
      fresh.innerHTML = await response.text();
      for (const part of fresh.content.querySelectorAll("[data-part]")) {
        const current = document.getElementById(part.id);
        if (current) current.replaceWith(part);
      }
      draw();
    } catch (err) {
      // The next round tries again; the page says when its figures were summed.
    }
  }

  window.addEventListener("load", () => {
    draw();
    setInterval(refresh, 15000);
  });
})();
