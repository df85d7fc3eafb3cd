"""The console's pages and JSON endpoints, one module per subject. Short function views: fetch, check the role, call an
action or a read model, render. Rules, audits and state changes live in the actions (recovery.actions)."""

import functools
import json

from recovery.http import json_error
from workers import protocol


def _field_with_nul(request, kwargs: dict) -> str | None:
    """A NUL character cannot be stored (PostgreSQL text refuses it) and is in no name Lifeline has: the field that
    carries one, in the path, the query or the JSON body."""
    for name, value in kwargs.items():
        if isinstance(value, str) and "\x00" in value:
            return name
    for name, values in request.GET.lists():
        if "\x00" in name or any("\x00" in v for v in values):
            return name
    if b"\\u0000" in request.body:  # JSON spells a NUL so; a body that is not JSON is the view's to refuse
        try:
            protocol.refuse_nul(json.loads(request.body))
        except protocol.ProtocolError as exc:
            return exc.field
        except (ValueError, RecursionError):
            return None
    return None


def refuse_nul(request, kwargs: dict):
    """The 400 naming the field that carries a NUL character, or None."""
    field = _field_with_nul(request, kwargs)
    if field is None:
        return None
    return json_error(400, f"{field}: must not contain a NUL character (\\u0000).", field=field)


def limit_param(request, default: int, maximum: int, things: str):
    """?limit=, a whole number from 1 to `maximum` (`default` when absent); or the 400 that says what it must be."""
    try:
        limit = int(request.GET.get("limit", default))
    except ValueError:
        return json_error(400, f"limit: not a whole number of {things}, e.g. {default}", param="limit")
    if not 1 <= limit <= maximum:
        return json_error(400, f"limit: from 1 to {maximum} {things}, not {limit}", param="limit")
    return limit


def allow(*methods: str):
    """A JSON endpoint that answers only `methods` (HEAD with GET): any other is a 405 naming those it answers, not a
    GET's answer in disguise; and a NUL character anywhere in what is sent is a 400 naming its field. Inside
    api_view, so a stranger is asked for a token first."""
    allowed = {*methods, *(("HEAD",) if "GET" in methods else ())}

    def decorator(view):
        @functools.wraps(view)
        def wrapper(request, *args, **kwargs):
            if request.method not in allowed:
                response = json_error(
                    405, f"{request.method} is not answered here: use {' or '.join(methods)}.", field="method"
                )
                response["Allow"] = ", ".join(sorted(allowed))
                return response
            return refuse_nul(request, kwargs) or view(request, *args, **kwargs)

        return wrapper

    return decorator
