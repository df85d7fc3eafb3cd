// Live cluster page: one WebSocket; nodes as tiles or as a sortable, filterable table, replaced on state changes
// and updated in place on heartbeats, all changes of an animation frame applied together; the routing panel and the
// traffic charts refreshed on a timer.
(function () {
  "use strict";
  const nodes = document.querySelector("[data-cluster]");
  if (!nodes) return;
  const view = nodes.dataset.view || "tiles";
  const table = view === "table" ? document.getElementById("node-table") : null;
  const statusEl = document.getElementById("live-status");
  const missS = parseFloat(nodes.dataset.missS || "3");
  let skewMs = 0; // server clock minus browser clock
  let retry = 0;

  function setStatus(state, text) {
    statusEl.dataset.state = state;
    statusEl.textContent = text;
  }

  function formatAge(seconds) {
    if (seconds < 10) return seconds.toFixed(1) + " s ago";
    if (seconds < 120) return Math.round(seconds) + " s ago";
    if (seconds < 7200) return Math.round(seconds / 60) + " min ago";
    return Math.round(seconds / 3600) + " h ago";
  }

  // A node that is down or gone has a stale report however recent its last beat was.
  function tickAges() {
    const now = (Date.now() + skewMs) / 1000;
    for (const el of nodes.querySelectorAll("[data-reported-at]")) {
      const at = parseFloat(el.dataset.reportedAt);
      if (Number.isNaN(at)) { el.textContent = "n/a"; continue; }
      const age = Math.max(now - at, 0);
      el.textContent = formatAge(age);
      el.classList.toggle("stale", el.dataset.alive === "0" || age > missS);
    }
  }

  // --- the table: sort and filter in the browser, kept through every live update --------------------------------
  const params = new URLSearchParams(location.search);
  const filterEl = document.getElementById("node-filter");
  const stateEl = document.getElementById("node-state-filter");
  const countEl = document.getElementById("node-count");
  let sortCol = "name";
  let sortDir = 1;
  if (table) {
    const sort = params.get("sort") || "name";
    sortDir = sort.startsWith("-") ? -1 : 1;
    sortCol = sort.replace(/^-/, "");
    if (!table.querySelector('th[data-col="' + CSS.escape(sortCol) + '"]')) { sortCol = "name"; sortDir = 1; }
    filterEl.value = params.get("q") || "";
    stateEl.value = params.get("state") || "";
  }

  function rows() { return Array.from(table.tBodies[0].querySelectorAll("tr[data-node]")); }

  function matches(row) {
    const state = stateEl.value;
    if (state === "problem" && !(row.dataset.tone === "warn" || row.dataset.tone === "bad")) return false;
    if (state && state !== "problem" && row.dataset.state !== state) return false;
    const text = (row.dataset.search || "").toLowerCase();
    return filterEl.value.toLowerCase().split(/\s+/).every((term) => !term || text.includes(term));
  }

  function applyFilter(only) {
    for (const row of only || rows()) row.hidden = !matches(row);
    const all = rows();
    countEl.textContent = all.filter((r) => !r.hidden).length + " of " + all.length + " nodes";
  }

  function sortValue(row) {
    const cell = row.querySelector('td[data-col="' + sortCol + '"]');
    return cell ? cell.dataset.sort : "";
  }

  function compare(a, b) {
    const numeric = table.querySelector('th[data-col="' + sortCol + '"]').hasAttribute("data-numeric");
    let x = sortValue(a), y = sortValue(b);
    if (numeric) {
      x = x === "" ? NaN : parseFloat(x);
      y = y === "" ? NaN : parseFloat(y);
      // n/a sorts last whichever way: a node that cannot report is not the least loaded
      if (Number.isNaN(x) || Number.isNaN(y)) {
        if (Number.isNaN(x) !== Number.isNaN(y)) return Number.isNaN(x) ? 1 : -1;
      } else if (x !== y) {
        return (x - y) * sortDir;
      }
    } else if (x !== y) {
      return x.localeCompare(y) * sortDir;
    }
    return a.dataset.node.localeCompare(b.dataset.node);
  }

  function applySort() {
    const body = table.tBodies[0];
    const current = rows();
    const sorted = current.slice().sort(compare);
    if (sorted.every((row, i) => row === current[i])) return; // already in order: touch nothing
    for (const row of sorted) body.appendChild(row);
  }

  function markSortHeader() {
    for (const th of table.tHead.rows[0].cells) {
      if (th.dataset.col === sortCol) th.setAttribute("aria-sort", sortDir > 0 ? "ascending" : "descending");
      else th.removeAttribute("aria-sort");
    }
  }

  function keepInUrl() {
    const next = new URLSearchParams(location.search);
    next.set("view", "table");
    const sort = (sortDir < 0 ? "-" : "") + sortCol;
    if (sort === "name") next.delete("sort"); else next.set("sort", sort);
    if (filterEl.value) next.set("q", filterEl.value); else next.delete("q");
    if (stateEl.value) next.set("state", stateEl.value); else next.delete("state");
    history.replaceState(null, "", location.pathname + "?" + next.toString());
  }

  function setUpTable() {
    table.tHead.addEventListener("click", (event) => {
      const th = event.target.closest("th[data-col]");
      if (!th) return;
      if (th.dataset.col === sortCol) sortDir = -sortDir; else { sortCol = th.dataset.col; sortDir = 1; }
      markSortHeader();
      applySort();
      keepInUrl();
    });
    filterEl.addEventListener("input", () => { applyFilter(); keepInUrl(); });
    stateEl.addEventListener("change", () => { applyFilter(); keepInUrl(); });
    markSortHeader();
    applySort();
    applyFilter();
  }

  // --- live updates, batched per animation frame ------------------------------------------------------------------
  const nodeFrames = new Map(); // name -> latest "node" frame (a re-rendered tile or row)
  const loadFrames = new Map(); // name -> latest figures of its heartbeats (from "loads" frames)
  let summaryHtml = null;
  let scheduled = false;

  function schedule() {
    if (scheduled) return;
    scheduled = true;
    requestAnimationFrame(flush);
  }

  async function refreshNodes() {
    // A node this page cannot place (a rack it has not seen), or after a reconnect: fetch the fragment anew.
    const response = await fetch(nodes.dataset.partialUrl, { credentials: "same-origin" });
    if (!response.ok) return;
    if (table) {
      const holder = document.createElement("div");
      holder.innerHTML = await response.text();
      const body = holder.querySelector("#node-table tbody");
      if (body) table.tBodies[0].replaceWith(body);
      applySort();
      applyFilter();
    } else {
      nodes.innerHTML = await response.text();
    }
    tickAges();
  }

  function fromHtml(html, tag) {
    const holder = document.createElement(tag);
    holder.innerHTML = html;
    return holder.firstElementChild;
  }

  function placeNode(frame) {
    const existing = document.getElementById("node-" + frame.name);
    const element = table ? fromHtml(frame.html, "tbody") : fromHtml(frame.html, "div");
    if (existing) {
      existing.replaceWith(element);
      return element;
    }
    if (table) {
      const empty = table.tBodies[0].querySelector(".empty-row");
      if (empty) empty.remove();
      table.tBodies[0].appendChild(element);
      return element;
    }
    const rack = nodes.querySelector('[data-rack="' + CSS.escape(frame.rack) + '"] .tiles');
    if (!rack) { refreshNodes(); return null; }
    // Keep tiles sorted by name so they never jump between refreshes.
    const after = Array.from(rack.children).find((el) => el.dataset.node > frame.name);
    rack.insertBefore(element, after || null);
    return element;
  }

  function setField(el, field, text, sort) {
    const target = el.querySelector('[data-field="' + field + '"]');
    if (!target) return;
    target.textContent = text;
    if (sort !== undefined && target.dataset.sort !== undefined) target.dataset.sort = sort;
  }

  function applyLoad(frame) {
    const el = document.getElementById("node-" + frame.name);
    if (!el || !(el.dataset.state === "serving" || el.dataset.state === "join")) return null;
    const report = el.querySelector("[data-reported-at]");
    // Figures are published a few times a second, a node's re-rendering at once: older figures than drawn stay out.
    if (report && report.dataset.reportedAt && frame.at < parseFloat(report.dataset.reportedAt)) return null;
    const pct = frame.kv_total ? (100 * frame.kv_used / frame.kv_total) : null;
    const step = frame.step_ms === null || frame.step_ms === undefined ? null : frame.step_ms;
    setField(el, "running", frame.running, frame.running);
    setField(el, "waiting", frame.waiting, frame.waiting);
    setField(el, "kv", pct === null ? "n/a" : pct.toFixed(1) + "%", pct === null ? "" : pct.toFixed(1));
    setField(el, "step", step === null ? "n/a" : step.toFixed(1) + " ms", step === null ? "" : step);
    const bar = el.querySelector('[data-field="kvbar"]');
    if (bar) bar.style.width = (pct || 0) + "%";
    if (report) {
      report.dataset.reportedAt = frame.at;
      const cell = report.closest("td");
      if (cell) cell.dataset.sort = frame.at;
    }
    return el;
  }

  // The summary's Running and Waiting are the sums of what is drawn: load frames move the nodes many times a
  // second, and the summary must never disagree with what is below it.
  function sumNodes() {
    for (const field of ["running", "waiting"]) {
      const card = document.querySelector('#summary [data-count="' + field + '"]');
      if (!card) continue;
      let total = 0;
      for (const el of nodes.querySelectorAll('[data-node] [data-field="' + field + '"]')) {
        const value = parseInt(el.textContent, 10);
        if (!Number.isNaN(value)) total += value;
      }
      card.textContent = total;
    }
  }

  function flush() {
    scheduled = false;
    const touched = [];
    for (const frame of nodeFrames.values()) {
      const el = placeNode(frame);
      if (el) touched.push(el);
    }
    nodeFrames.clear();
    for (const frame of loadFrames.values()) {
      const el = applyLoad(frame);
      if (el) touched.push(el);
    }
    loadFrames.clear();
    if (summaryHtml !== null) {
      document.getElementById("summary").innerHTML = summaryHtml;
      summaryHtml = null;
    }
    if (table && touched.length) {
      applySort();
      applyFilter(touched);
    }
    sumNodes();
    if (touched.length) tickAges();
  }

  function connect() {
    const scheme = location.protocol === "https:" ? "wss://" : "ws://";
    const socket = new WebSocket(scheme + location.host + "/ws/cluster/?view=" + view);
    socket.onopen = () => { retry = 0; setStatus("live", "live"); };
    socket.onmessage = (message) => {
      const frame = JSON.parse(message.data);
      if (frame.kind === "hello") {
        skewMs = frame.now * 1000 - Date.now();
      } else if (frame.kind === "node") {
        nodeFrames.set(frame.name, frame);
        loadFrames.delete(frame.name); // figures older than the new rendering
        if (frame.summary) summaryHtml = frame.summary;
        schedule();
      } else if (frame.kind === "loads") {
        for (const figures of frame.nodes) loadFrames.set(figures.name, figures);
        schedule();
      }
    };
    socket.onclose = (event) => {
      if (event.code === 4403) { setStatus("closed", "not allowed"); return; }
      setStatus("reconnecting", "reconnecting…");
      retry = Math.min(retry + 1, 6);
      setTimeout(() => { refreshNodes(); connect(); }, 250 * 2 ** retry);
    };
  }

  // --- routing: why traffic goes where it goes, refreshed from the same arithmetic the gateways use --------------
  const routing = document.getElementById("routing");
  async function refreshRouting() {
    if (!routing) return;
    const open = new Set(Array.from(routing.querySelectorAll("[data-model] details[open]"))
      .map((d) => d.closest("[data-model]").dataset.model));
    const response = await fetch(routing.dataset.partialUrl, { credentials: "same-origin" });
    if (!response.ok) return;
    routing.innerHTML = await response.text();
    for (const el of routing.querySelectorAll("[data-model]")) {
      const details = el.querySelector("details");
      if (details && open.has(el.dataset.model)) details.open = true;
    }
  }

  // --- traffic charts, in UTC -------------------------------------------------------------------------------------
  const traffic = document.getElementById("traffic");
  const minutesEl = document.getElementById("traffic-minutes");
  // The console's one rule for time (time.js): x values as UTC date strings, which Plotly draws as written, on an
  // axis titled UTC (Plotly would draw a Date in the browser's zone).
  const time = window.LifelineTime;
  const palette = ["#58a6ff", "#3fb950", "#d29922", "#bc8cff", "#2dd4bf", "#f778ba", "#f85149", "#8b949e"];
  const layout = (title, extra) => ({
    paper_bgcolor: "#161b22", plot_bgcolor: "#161b22", font: { color: "#e6edf3", size: 11 },
    // The legend below the axis title, one entry per model and tier (its dotted or dashed twin shares the entry):
    // at 1,000 px it takes two rows, which the height leaves room for, never over the axis title.
    margin: { l: 55, r: 15, t: 30, b: 45 }, height: 300, showlegend: true,
    legend: { orientation: "h", y: -0.3, yanchor: "top" },
    title: { text: title, font: { size: 12 }, x: 0.01 },
    xaxis: time.axis({ gridcolor: "#2a323d", title: { text: "time (UTC)", standoff: 2 } }),
    yaxis: { gridcolor: "#2a323d", rangemode: "tozero", ...extra },
  });

  function drawCharts(data) {
    if (!window.Plotly || !time) return;
    const x = time.plotXs(data.t);
    const traces = { ttft: [], tpot: [], tokens: [], errors: [] };
    data.series.forEach((s, i) => {
      const color = palette[i % palette.length];
      // Markers too: a bucket between two empty ones is a point, which a line alone would not draw.
      const line = (y, name, dash, extra) => ({ x, y, name, mode: "lines+markers", connectgaps: false,
        line: { color, dash: dash || "solid", width: 1.5 }, marker: { size: 4 }, legendgroup: s.label, ...extra });
      const twin = { showlegend: false };  // in its solid line's legend entry: one click toggles both
      traces.ttft.push(line(s.ttft_p50, s.label + " p50"), line(s.ttft_p99, s.label + " p99", "dot", twin));
      traces.tpot.push(line(s.tpot_p50, s.label + " p50"), line(s.tpot_p99, s.label + " p99", "dot", twin));
      traces.tokens.push(line(s.tokens_per_s, s.label));
      traces.errors.push(line(s.error_pct, s.label + " errors"), line(s.shed_pct, s.label + " shed", "dash", twin));
    });
    const options = { displayModeBar: false, responsive: true };
    Plotly.react("chart-ttft", traces.ttft, layout("TTFT (ms), p50 solid, p99 dotted", { title: { text: "ms" } }), options);
    Plotly.react("chart-tpot", traces.tpot, layout("TPOT (ms), p50 solid, p99 dotted", { title: { text: "ms" } }), options);
    Plotly.react("chart-tokens", traces.tokens, layout("tokens per second", { title: { text: "tokens/s" } }), options);
    Plotly.react("chart-errors", traces.errors,
      layout("errors solid, shed dashed, % of requests", { title: { text: "%" }, range: [0, 100] }), options);
    const note = document.getElementById("traffic-note");
    note.textContent = data.requests
      ? data.requests + " requests in the last " + data.minutes + " min, in " + data.bucket_s + " s buckets (UTC" +
        (data.truncated ? "; the newest only" : "") + "). Shed counts the requests gateways report as shed."
      : "No request finished in the last " + data.minutes + " min: nothing to chart.";
  }

  async function refreshCharts() {
    if (!traffic) return;
    const response = await fetch(traffic.dataset.seriesUrl + "?minutes=" + minutesEl.value, { credentials: "same-origin" });
    if (response.ok) drawCharts(await response.json());
  }

  if (table) setUpTable();
  tickAges();
  setInterval(tickAges, 500);
  connect();
  setInterval(refreshRouting, 5000);
  if (minutesEl) minutesEl.addEventListener("change", refreshCharts);
  window.addEventListener("load", () => { refreshCharts(); setInterval(refreshCharts, 10000); });
})();
