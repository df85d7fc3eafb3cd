import datetime as dt
import time

from django import template

from workers import telemetry

register = template.Library()


@register.filter
def ago(epoch):
    """'0.8 s ago' for an epoch timestamp; n/a when there is none."""
    if epoch in (None, ""):
        return "n/a"
    age = max(time.time() - float(epoch), 0)
    if age < 10:
        return f"{age:.1f} s ago"
    if age < 120:
        return f"{age:.0f} s ago"
    if age < 7200:
        return f"{age / 60:.0f} min ago"
    return f"{age / 3600:.0f} h ago"


@register.filter
def na(value, suffix=""):
    """Show 'n/a' for a figure a node cannot report, never a healthy-looking zero."""
    if value is None or value == "":
        return "n/a"
    return f"{value}{suffix}"


@register.filter
def utc(moment, precision="ms"):
    """The console's one way to write a time: UTC, with the date and the zone's name.

    `moment` is epoch seconds or an aware datetime. Timelines read to the millisecond
    ("2026-11-23 22:50:20.123 UTC", the default); lists to the minute (`|utc:"min"`,
    "2026-11-23 22:50 UTC"); `|utc:"s"` to the second. The charts' axes follow the
    same rule (static/console/time.js).
    """
    if moment in (None, ""):
        return "—"
    if not isinstance(moment, dt.datetime):
        moment = dt.datetime.fromtimestamp(float(moment), tz=dt.UTC)
    moment = moment.astimezone(dt.UTC)
    if precision == "min":
        return moment.strftime("%Y-%m-%d %H:%M UTC")
    if precision == "s":
        return moment.strftime("%Y-%m-%d %H:%M:%S UTC")
    return moment.strftime("%Y-%m-%d %H:%M:%S.") + f"{moment.microsecond // 1000:03d} UTC"


@register.filter
def since(epoch, start):
    """'+1.234 s' from `start` to `epoch`, both epoch seconds."""
    if epoch in (None, "") or start in (None, ""):
        return "—"
    delta = float(epoch) - float(start)
    return f"+{delta * 1000:.0f} ms" if abs(delta) < 10 else f"+{delta:.1f} s"


@register.filter
def human_bytes(value):
    if value in (None, ""):
        return "n/a"
    value = float(value)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"


@register.filter
def get(mapping, key):
    return (mapping or {}).get(key)


@register.filter
def percent(value):
    return "n/a" if value is None else f"{100 * float(value):.0f}%"


THROTTLE_LABELS = (
    (telemetry.THROTTLE_IDLE, "idle"),
    (telemetry.THROTTLE_SW_POWER_CAP, "power cap"),
    (telemetry.THROTTLE_HW_SLOWDOWN, "hardware slowdown"),
    (telemetry.THROTTLE_SW_THERMAL, "thermal (software)"),
    (telemetry.THROTTLE_HW_THERMAL, "thermal (hardware)"),
    (telemetry.THROTTLE_POWER_BRAKE, "power brake"),
)


@register.filter
def throttle(mask):
    """NVML's clock-event bitmask in words: 'none', 'idle', 'thermal (software), thermal (hardware)'; n/a if unknown."""
    if mask in (None, ""):
        return "n/a"
    mask = int(mask)
    if mask == 0:
        return "none"
    named = [label for bit, label in THROTTLE_LABELS if mask & bit]
    rest = mask & ~sum(bit for bit, _ in THROTTLE_LABELS)
    if rest:
        named.append(f"other (0x{rest:x})")
    return ", ".join(named)
