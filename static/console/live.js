// A list page kept live: any frame on its socket refreshes its server-rendered fragment.
(function () {
  "use strict";
  const target = document.querySelector("[data-socket]");
  if (!target) return;
  const statusEl = document.getElementById("live-status");
  const body = document.querySelector(target.dataset.liveInto || "") || target;
  let pending = null;
  let retry = 0;

  function refresh() {
    if (pending) return;
    pending = setTimeout(async () => {
      pending = null;
      const response = await fetch(target.dataset.livePartial, { credentials: "same-origin" });
      if (response.ok) body.innerHTML = await response.text();
    }, 300);
  }

  function connect() {
    const scheme = location.protocol === "https:" ? "wss://" : "ws://";
    const socket = new WebSocket(scheme + location.host + target.dataset.socket);
    socket.onopen = () => { retry = 0; statusEl.dataset.state = "live"; statusEl.textContent = "live"; };
    socket.onmessage = () => refresh();
    socket.onclose = (event) => {
      if (event.code === 4403) { statusEl.dataset.state = "closed"; statusEl.textContent = "not allowed"; return; }
      statusEl.dataset.state = "reconnecting"; statusEl.textContent = "reconnecting…";
      retry = Math.min(retry + 1, 6);
      setTimeout(() => { refresh(); connect(); }, 250 * 2 ** retry);
    };
  }
  connect();
})();
