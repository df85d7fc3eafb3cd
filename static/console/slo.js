// /slo/: the objectives table refreshed from the server's own fragment every 15 s (rollups move each minute).
(function () {
  const panel = document.getElementById("slo-table");
  if (!panel) return;
  const url = panel.dataset.refreshUrl;
  async function refresh() {
    try {
      const response = await fetch(url, { headers: { "X-Requested-With": "fetch" }, credentials: "same-origin" });
      if (response.ok) panel.innerHTML = await response.text();
    } catch (err) {
      // The next round tries again; the figures on the page say how old they are.
    }
  }
  setInterval(refresh, 15000);
})();
