// A list page kept live: any frame on its socket refreshes its server-rendered fragment.
// What the user is typing in a form inside the fragment (a reason to approve a drain, say)
// survives the refresh, with the focus and the cursor where they were.
(function () {
  "use strict";
  const target = document.querySelector("[data-socket]");
  if (!target) return;
  const statusEl = document.getElementById("live-status");
  const body = (target.dataset.liveInto && document.querySelector(target.dataset.liveInto)) || target;
  let pending = null;
  let retry = 0;
  // A click in progress (pointer down, not yet up) or a form on its way to the server: the fragment is not
  // swapped under it, or the click lands on a button that is no longer there and the decision is lost.
  let pressed = false;
  let submitting = false;
  body.addEventListener("pointerdown", () => { pressed = true; });
  document.addEventListener("pointerup", () => { setTimeout(() => { pressed = false; }, 0); });
  document.addEventListener("pointercancel", () => { pressed = false; });
  body.addEventListener("submit", () => { submitting = true; });
  window.addEventListener("pageshow", () => { submitting = false; });  // back again (from the history)

  function fieldKey(el) {
    return (el.form && el.form.id ? el.form.id : "") + "|" + el.name;
  }

  function typedFields() {
    const typed = new Map();
    body.querySelectorAll("input[name], textarea[name], select[name]").forEach((el) => {
      if (el.type === "hidden" || el.type === "submit") return;
      const checkable = el.type === "checkbox" || el.type === "radio";
      const changed = checkable ? el.checked !== el.defaultChecked : el.value !== el.defaultValue;
      const focused = el === document.activeElement;
      if (!changed && !focused) return;
      typed.set(fieldKey(el) + (el.type === "radio" ? "=" + el.value : ""), {
        value: el.value, checked: el.checked, checkable, focused,
        selection: focused && "selectionStart" in el ? [el.selectionStart, el.selectionEnd] : null,
      });
    });
    return typed;
  }

  function restore(typed) {
    if (!typed.size) return;
    body.querySelectorAll("input[name], textarea[name], select[name]").forEach((el) => {
      const kept = typed.get(fieldKey(el) + (el.type === "radio" ? "=" + el.value : ""));
      if (!kept) return;
      if (kept.checkable) el.checked = kept.checked; else el.value = kept.value;
      if (kept.focused) {
        el.focus();
        if (kept.selection) {
          try { el.setSelectionRange(kept.selection[0], kept.selection[1]); } catch (e) { /* not a text field */ }
        }
      }
    });
  }

  function refresh() {
    if (pending) return;
    pending = setTimeout(async () => {
      pending = null;
      if (submitting) return;  // the page is leaving for the form's answer
      if (pressed) { refresh(); return; }  // after the click
      const response = await fetch(target.dataset.livePartial, { credentials: "same-origin" });
      if (!response.ok) return;
      const html = await response.text();
      if (submitting || pressed) { if (!submitting) refresh(); return; }  // a click began while fetching
      const typed = typedFields();  // read just before the swap: nothing typed while fetching is lost
      body.innerHTML = html;
      restore(typed);
      document.dispatchEvent(new CustomEvent("live:refreshed", { detail: { target: body } }));
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
