import time

from django import template

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
