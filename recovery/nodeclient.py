"""The control plane's thin client for node agents (the seam tests may replace).

Synchronous and short: it runs in Celery tasks and management commands,
never on a request's path.
"""

import json
import urllib.error
import urllib.request

from django.conf import settings


class NodeUnreachable(Exception):
    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out  # it may be there and slow: no answer in time is not a refusal


def call(
    address: str, method: str, path: str, body: dict | None = None, timeout: float = 2.0, token: str | None = None
) -> tuple[int, dict]:
    """(status, JSON answer) from a node agent; NodeUnreachable when it does not answer."""
    token = token if token is not None else settings.LIFELINE_AGENT_TOKEN
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(address + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"{}")
        except ValueError:
            return exc.code, {}
    except (urllib.error.URLError, TimeoutError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise NodeUnreachable(f"{address}: {reason}", timed_out=isinstance(reason, TimeoutError)) from None


LOADING = {"loading_draft", "draft_ready", "loading_full"}


def alive(address: str, timeout: float = 0.5) -> tuple[bool | None, str]:
    """Whether the node is up, and what it said: serving, or loading its model, counts as up; a refused
    connection, or a lost GPU, does not. None: no answer within `timeout` (up and slow, or hung: the caller
    decides by what else it knows)."""
    try:
        status, body = call(address, "GET", "/health", timeout=timeout)
    except NodeUnreachable as exc:
        if exc.timed_out:
            return None, f"/health does not answer within {timeout:g} s ({exc})"
        return False, f"/health does not answer ({exc})"
    state = body.get("status", "")
    if status == 200 or state in LOADING:
        return True, f"/health answers {state or status}"
    return False, f"/health answers {status} {state}".strip()
