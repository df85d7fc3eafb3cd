// Every page: the degradation banner, the drains-waiting count in the nav and the page title's "(n) " prefix
// follow the control plane live. The banner's fragment carries the count (data-drains-waiting).
(function () {
  "use strict";
  const banner = document.getElementById("banner");
  if (!banner) return;
  const count = document.getElementById("drains-waiting");
  let retry = 0;
  let pending = null;

  function showWaiting() {
    const shown = banner.querySelector("[data-drains-waiting]");
    if (!shown) return;
    const waiting = Number(shown.dataset.drainsWaiting) || 0;
    if (count) {
      count.textContent = String(waiting);
      count.hidden = waiting === 0;
    }
    const title = document.title.replace(/^\(\d+\) /, "");
    document.title = waiting ? "(" + waiting + ") " + title : title;
  }

  function refresh() {
    if (pending) return;
    pending = setTimeout(async () => {
      pending = null;
      const response = await fetch(banner.dataset.bannerUrl, { credentials: "same-origin" });
      if (!response.ok) return;
      banner.innerHTML = await response.text();
      showWaiting();
    }, 200);
  }

  function connect() {
    const scheme = location.protocol === "https:" ? "wss://" : "ws://";
    const socket = new WebSocket(scheme + location.host + "/ws/status/");
    socket.onopen = () => { retry = 0; };
    socket.onmessage = () => refresh();
    socket.onclose = (event) => {
      if (event.code === 4403) return;
      retry = Math.min(retry + 1, 6);
      setTimeout(() => { refresh(); connect(); }, 250 * 2 ** retry);
    };
  }
  connect();
})();
