// The console's one rule for time, in the browser: UTC with the date, as the server's `utc` template filter
// writes it. Charts get their x values as UTC date strings (Plotly draws a Date in the browser's own zone) and
// an axis titled "UTC". Loaded by every page (templates/base.html), before the page's own scripts.
(function () {
  "use strict";
  const pad = (n, width) => String(n).padStart(width || 2, "0");

  // "2026-11-23 22:50:20.123": epoch seconds as a UTC date string, which Plotly draws as it reads.
  function plotX(epochSeconds) {
    if (epochSeconds === null || epochSeconds === undefined) return null;
    return new Date(epochSeconds * 1000).toISOString().replace("T", " ").replace("Z", "");
  }

  // "2026-11-23 22:50:20.123 UTC" (precision "ms", the default), "… 22:50:20 UTC" ("s"), "… 22:50 UTC" ("min").
  function format(epochSeconds, precision) {
    if (epochSeconds === null || epochSeconds === undefined) return "—";
    const d = new Date(epochSeconds * 1000);
    const day = d.getUTCFullYear() + "-" + pad(d.getUTCMonth() + 1) + "-" + pad(d.getUTCDate());
    const minute = day + " " + pad(d.getUTCHours()) + ":" + pad(d.getUTCMinutes());
    if (precision === "min") return minute + " UTC";
    const second = minute + ":" + pad(d.getUTCSeconds());
    if (precision === "s") return second + " UTC";
    return second + "." + pad(d.getUTCMilliseconds(), 3) + " UTC";
  }

  // A Plotly x axis in UTC: the given settings, typed as dates and titled so nobody reads it as local time.
  function axis(settings) {
    return Object.assign({ type: "date", title: { text: "time (UTC)" } }, settings || {});
  }

  window.LifelineTime = {
    format,
    plotX,
    plotXs: (epochs) => (epochs || []).map(plotX),
    axis,
  };
})();
