// Every page: the degradation banner and the drains-waiting count follow the control plane live.
(function () {
  "use strict";
  const banner = document.getElementById("banner");
  if (!banner) return;
  let retry = 0;
  let pending = null;

  function refresh() {
    if (pending) return;
    pending = setTimeout(async () => {
      pending = null;
      const response = await fetch(banner.dataset.bannerUrl, { credentials: "same-origin" });
      if (response.ok) banner.innerHTML = await response.text();
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
