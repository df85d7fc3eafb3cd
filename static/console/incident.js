// The incident page: its timeline grows live, its facts and chart follow.
(function () {
  "use strict";
  const timeline = document.getElementById("timeline");
  const events = document.getElementById("events");
  const statusEl = document.getElementById("live-status");
  const facts = document.getElementById("facts");
  const chartEl = document.getElementById("latency-chart");
  const hideSystem = document.getElementById("hide-system");
  let retry = 0;

  function applyFilter() {
    events.classList.toggle("hide-system", hideSystem.checked);
  }
  hideSystem.addEventListener("change", applyFilter);

  function draw(data) {
    if (!window.Plotly) return;
    const t = LifelineTime.plotXs(data.t);  // UTC, as the timeline below it
    const traces = [
      { x: t, y: data.ttft_ms, name: "TTFT (ms)", mode: "markers", marker: { size: 5, color: "#58a6ff" } },
      { x: t, y: data.tpot_ms, name: "TPOT (ms)", mode: "markers", yaxis: "y2", marker: { size: 5, color: "#d29922" } },
    ];
    const shapes = [];
    const marks = { opened: "#f85149", detected: "#f0883e", recovered: "#3fb950", capacity_restored: "#a371f7" };
    for (const [name, color] of Object.entries(marks)) {
      if (data.marks[name]) {
        const at = LifelineTime.plotX(data.marks[name]);
        shapes.push({ type: "line", x0: at, x1: at, yref: "paper", y0: 0, y1: 1, line: { color, width: 1.5, dash: "dot" } });
      }
    }
    const layout = {
      paper_bgcolor: "#161b22", plot_bgcolor: "#161b22", font: { color: "#e6edf3", size: 11 },
      margin: { l: 50, r: 50, t: 30, b: 40 }, height: 300, showlegend: true,
      legend: { orientation: "h", x: 0, y: 1.02, yanchor: "bottom" },  // above: the x axis below carries dates and "UTC"
      xaxis: LifelineTime.axis({ gridcolor: "#2a323d" }), yaxis: { title: "TTFT ms", gridcolor: "#2a323d" },
      yaxis2: { title: "TPOT ms", overlaying: "y", side: "right", showgrid: false }, shapes,
    };
    Plotly.react(chartEl, traces, layout, { displayModeBar: false, responsive: true });
  }

  async function refreshFacts() {
    const response = await fetch(facts.dataset.factsUrl, { credentials: "same-origin" });
    if (response.ok) facts.innerHTML = await response.text();
    const chart = await fetch(chartEl.dataset.chartUrl, { credentials: "same-origin" });
    if (chart.ok) draw(await chart.json());
  }

  // A row goes where its time puts it: a reaction can write an event a moment after a later one.
  function insertInOrder(html) {
    const template = document.createElement("template");
    template.innerHTML = html.trim();
    const row = template.content.firstElementChild;
    const at = parseFloat(row.dataset.at);
    const later = Array.from(events.querySelectorAll("tr[data-at]")).find((r) => parseFloat(r.dataset.at) > at);
    events.insertBefore(row, later || null);
  }

  function lastEventId() {
    return Math.max(0, ...Array.from(events.querySelectorAll("tr[data-event]")).map((r) => parseInt(r.dataset.event, 10)));
  }

  function connect() {
    const scheme = location.protocol === "https:" ? "wss://" : "ws://";
    // `after`: the server sends every event written since the newest one this page shows, so nothing written
    // between the page's render (or a dropped connection) and this subscription is missed.
    const socket = new WebSocket(scheme + location.host + timeline.dataset.socket + "?after=" + lastEventId());
    socket.onopen = () => {
      retry = 0; statusEl.dataset.state = "live"; statusEl.textContent = "live";
      refreshFacts();  // what changed between the render (or a dropped connection) and now
    };
    socket.onmessage = (message) => {
      const frame = JSON.parse(message.data);
      if (frame.kind === "event" && !events.querySelector('[data-event="' + frame.id + '"]')) {
        insertInOrder(frame.html);
      } else if (frame.kind === "incident") {
        refreshFacts();
      }
    };
    socket.onclose = (event) => {
      if (event.code === 4403) { statusEl.dataset.state = "closed"; statusEl.textContent = "not allowed"; return; }
      statusEl.dataset.state = "reconnecting"; statusEl.textContent = "reconnecting…";
      retry = Math.min(retry + 1, 6);
      setTimeout(connect, 250 * 2 ** retry);
    };
  }

  window.addEventListener("load", () => draw(JSON.parse(document.getElementById("chart-data").textContent)));
  connect();
})();
