// The MoE page's charts, drawn from the fragment's data (#moe-data) when the page loads and each time live.js swaps
// the fragment in (a nudge on /ws/moe/ after every pass of the control plane's watch): the expert routing table as a
// heatmap (logical expert × expert worker: primary, shadow, none), tokens per expert, and balancedness over time.
(function () {
  "use strict";
  const time = window.LifelineTime;
  const base = { paper_bgcolor: "#161b22", plot_bgcolor: "#161b22", font: { color: "#e6edf3", size: 11 },
    margin: { l: 55, r: 15, t: 10, b: 45 }, height: 280 };
  const options = { displayModeBar: false, responsive: true };

  function draw() {
    const el = document.getElementById("moe-data");
    if (!el || !window.Plotly) return;
    const data = JSON.parse(el.textContent);
    const experts = data.heatmap.map((_, i) => "expert " + i);
    const text = data.heatmap.map((row) => row.map((v) => (v === 2 ? "primary" : v === 1 ? "shadow" : "")));
    const heat = document.getElementById("moe-heatmap");
    heat.dataset.version = data.version;
    heat.dataset.ews = data.ew_names.join(",");
    Plotly.react(heat, [{
      type: "heatmap", z: data.heatmap, x: data.ew_names, y: experts, text, texttemplate: "%{text}",
      zmin: 0, zmax: 2, showscale: false, xgap: 2, ygap: 2,
      colorscale: [[0, "#0d1117"], [0.5, "#1f6feb"], [1, "#3fb950"]],
      hovertemplate: "%{y} on %{x}: %{text}<extra></extra>",
    }], { ...base, yaxis: { autorange: "reversed" }, xaxis: { side: "top" }, margin: { l: 70, r: 10, t: 30, b: 10 } },
    options);
    Plotly.react("moe-tokens", [{
      type: "bar", x: data.tokens_per_expert.map((_, i) => String(i)), y: data.tokens_per_expert,
      marker: { color: "#58a6ff" }, hovertemplate: "expert %{x}: %{y} tokens<extra></extra>",
    }], { ...base, xaxis: { title: { text: "expert" }, type: "category" }, yaxis: { title: { text: "tokens" }, gridcolor: "#2a323d" } },
    options);
    const xs = time ? time.plotXs(data.balancedness.at) : data.balancedness.at;
    Plotly.react("moe-balance", [{
      x: xs, y: data.balancedness.value, mode: "lines", line: { color: "#d29922", width: 1.5 },
      hovertemplate: "%{y:.2f}<extra></extra>",
    }], { ...base, xaxis: time ? time.axis({ gridcolor: "#2a323d" }) : {}, yaxis: { range: [0, 1.05], gridcolor: "#2a323d" } },
    options);
  }

  document.addEventListener("live:refreshed", draw);
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", draw); else draw();
  window.addEventListener("load", draw);  // Plotly arrives deferred
})();
