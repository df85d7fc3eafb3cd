// /experiments/<id>/ and /experiments/compare/: a run's body re-rendered by the server every half second while the
// run is queued or running (its progress, its log), and each finished run's charts, drawn from the figures the
// server rendered into the page (experiment-chart-data-<id>): mean TTFT and mean TPOT over simulated time, one line
// per policy, each failure a dashed vertical line.
(function () {
  "use strict";
  const POLL_MS = 500;
  const COLORS = { none: "#f85149", fixed: "#d29922", load_aware: "#58a6ff", lifeline: "#3fb950" };
  const layout = {
    paper_bgcolor: "#161b22", plot_bgcolor: "#161b22", font: { color: "#e6edf3", size: 11 },
    margin: { l: 60, r: 20, t: 30, b: 45 }, height: 280, showlegend: true,
    legend: { orientation: "h", x: 0, y: 1.08, yanchor: "bottom" },
  };
  const config = { displayModeBar: false, responsive: true };
  const ms = (values) => values.map((v) => (v === null ? null : 1000 * v));

  function failures(chart) {
    const shapes = chart.faults.map((f) => ({
      type: "line", xref: "x", yref: "paper", x0: f.at_s, x1: f.at_s, y0: 0, y1: 1,
      line: { color: "#f85149", width: 1.5, dash: "dash" },
    }));
    const annotations = chart.faults.map((f) => ({
      xref: "x", yref: "paper", x: f.at_s, y: 1, yanchor: "bottom", showarrow: false,
      text: f.kind + " " + f.target, font: { color: "#f85149", size: 10 },
    }));
    return { shapes, annotations };
  }

  function plot(el, chart, key, title) {
    // Each mean is placed at its window's middle.
    const x = chart.starts.map((s) => s + chart.window_s / 2);
    const traces = chart.policies.map((line) => ({
      x, y: ms(line[key]), name: line.policy, mode: "lines+markers", connectgaps: false,
      line: { color: COLORS[line.policy] }, hovertemplate: "%{x:.1f} s: %{y:.1f} ms<extra>" + line.policy + "</extra>",
    }));
    Plotly.newPlot(el, traces, Object.assign({}, layout, failures(chart), {
      xaxis: { title: { text: "simulated time (s)" }, gridcolor: "#2a323d", rangemode: "tozero" },
      yaxis: { title: { text: title }, gridcolor: "#2a323d", rangemode: "tozero" },
    }), config);
  }

  function draw(root) {
    if (!window.Plotly) return;
    root.querySelectorAll(".experiment-results").forEach((section) => {
      const source = document.getElementById("experiment-chart-data-" + section.dataset.run);
      if (!source) return;
      const chart = JSON.parse(source.textContent);
      plot(section.querySelector("[data-figure=ttft]"), chart, "ttft_s", "mean TTFT (ms)");
      plot(section.querySelector("[data-figure=tpot]"), chart, "tpot_s", "mean TPOT (ms)");
    });
  }

  const body = document.getElementById("experiment-body");
  if (!body) { draw(document); return; }  // the compare page: finished runs only

  // A click in progress or a form on its way (the cancel button): the body is not swapped under it.
  let pressed = false;
  let submitting = false;
  body.addEventListener("pointerdown", () => { pressed = true; });
  document.addEventListener("pointerup", () => { setTimeout(() => { pressed = false; }, 0); });
  body.addEventListener("submit", () => { submitting = true; });

  function open() {
    const state = body.querySelector("#experiment-state");
    return state && state.dataset.open === "1";
  }

  function poll() {
    if (!open()) { draw(body); return; }
    setTimeout(async () => {
      if (submitting) return;  // the page is leaving for the form's answer
      try {
        const response = await fetch(body.dataset.poll, { credentials: "same-origin" });
        const html = response.ok ? await response.text() : null;
        if (html !== null && !pressed && !submitting) body.innerHTML = html;
      } catch (e) { /* the next poll tries again */ }
      poll();
    }, POLL_MS);
  }
  poll();
})();
