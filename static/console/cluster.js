// Live cluster page: one WebSocket, tiles replaced on state changes, figures on heartbeats.
(function () {
  "use strict";
  const racks = document.querySelector("[data-cluster]");
  if (!racks) return;
  const statusEl = document.getElementById("live-status");
  const missS = parseFloat(racks.dataset.missS || "3");
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

  function tickAges() {
    const now = (Date.now() + skewMs) / 1000;
    for (const el of document.querySelectorAll("[data-reported-at]")) {
      const at = parseFloat(el.dataset.reportedAt);
      if (Number.isNaN(at)) { el.textContent = "n/a"; continue; }
      const age = Math.max(now - at, 0);
      el.textContent = formatAge(age);
      el.classList.toggle("stale", age > missS);
    }
  }

  async function refreshRacks() {
    // A node in a rack this page has not seen: fetch the racks fragment instead of reloading.
    const response = await fetch(racks.dataset.partialUrl, { credentials: "same-origin" });
    if (response.ok) racks.innerHTML = await response.text();
  }

  function placeTile(frame) {
    const existing = document.getElementById("node-" + frame.name);
    if (existing) {
      existing.outerHTML = frame.html;
      return;
    }
    const rack = racks.querySelector('[data-rack="' + CSS.escape(frame.rack) + '"] .tiles');
    if (!rack) { refreshRacks(); return; }
    const holder = document.createElement("div");
    holder.innerHTML = frame.html;
    const tile = holder.firstElementChild;
    // Keep tiles sorted by name so rows never jump between refreshes.
    const after = Array.from(rack.children).find((el) => el.dataset.node > frame.name);
    rack.insertBefore(tile, after || null);
  }

  function setField(tile, field, text) {
    const el = tile.querySelector('[data-field="' + field + '"]');
    if (el) el.textContent = text;
  }

  function applyLoad(frame) {
    const tile = document.getElementById("node-" + frame.name);
    if (!tile || !(tile.dataset.state === "serving" || tile.dataset.state === "join")) return;
    setField(tile, "running", frame.running);
    setField(tile, "waiting", frame.waiting);
    const pct = frame.kv_total ? (100 * frame.kv_used / frame.kv_total) : null;
    setField(tile, "kv", pct === null ? "n/a" : pct.toFixed(1) + "%");
    setField(tile, "step", frame.step_ms === null || frame.step_ms === undefined ? "n/a" : frame.step_ms.toFixed(1) + " ms");
    const bar = tile.querySelector('[data-field="kvbar"]');
    if (bar) bar.style.width = (pct || 0) + "%";
    const report = tile.querySelector("[data-reported-at]");
    if (report) report.dataset.reportedAt = frame.at;
  }

  // The summary's Running and Waiting are the tiles' sums: load frames move the tiles many times a second,
  // and the summary must never disagree with what is drawn below it.
  function sumTiles() {
    for (const field of ["running", "waiting"]) {
      const card = document.querySelector('#summary [data-count="' + field + '"]');
      if (!card) continue;
      let total = 0;
      for (const el of document.querySelectorAll('.tile [data-field="' + field + '"]')) {
        const value = parseInt(el.textContent, 10);
        if (!Number.isNaN(value)) total += value;
      }
      card.textContent = total;
    }
  }

  function connect() {
    const scheme = location.protocol === "https:" ? "wss://" : "ws://";
    const socket = new WebSocket(scheme + location.host + "/ws/cluster/");
    socket.onopen = () => { retry = 0; setStatus("live", "live"); };
    socket.onmessage = (message) => {
      const frame = JSON.parse(message.data);
      if (frame.kind === "hello") {
        skewMs = frame.now * 1000 - Date.now();
      } else if (frame.kind === "node") {
        placeTile(frame);
        if (frame.summary) document.getElementById("summary").innerHTML = frame.summary;
        sumTiles();
      } else if (frame.kind === "load") {
        applyLoad(frame);
        sumTiles();
      }
    };
    socket.onclose = (event) => {
      if (event.code === 4403) { setStatus("closed", "not allowed"); return; }
      setStatus("reconnecting", "reconnecting…");
      retry = Math.min(retry + 1, 6);
      setTimeout(() => { refreshRacks(); connect(); }, 250 * 2 ** retry);
    };
  }

  tickAges();
  setInterval(tickAges, 500);
  connect();
})();
