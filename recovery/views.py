"""The node protocol's control-plane side: registration, heartbeats, leaving."""

import functools
import hmac
import json

from django.conf import settings
from django.http import JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from recovery.actions import nodes
from recovery.http import bearer_token, json_error
from workers.protocol import Heartbeat, ProtocolError, Registration


def node_endpoint(view):
    """Nodes authenticate with the cluster's node token and send JSON bodies."""

    @csrf_exempt
    @require_POST
    @functools.wraps(view)
    def wrapper(request, *args, **kwargs):
        expected = settings.LIFELINE_NODE_TOKEN
        if not expected:
            return json_error(
                503,
                "LIFELINE_NODE_TOKEN is not set on the control plane, so no node can register: "
                "set it and restart the console.",
            )
        token = bearer_token(request)
        if token is None or not hmac.compare_digest(token.encode(), expected.encode()):
            return json_error(
                401,
                "The node token is missing or wrong: "
                "start the node with LIFELINE_NODE_TOKEN set to the cluster's node token.",
            )
        try:
            body = json.loads(request.body or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError):
            return json_error(400, "The body is not valid JSON.", field="body")
        try:
            return view(request, body, *args, **kwargs)
        except ProtocolError as exc:
            return json_error(400, str(exc), field=exc.field)
        except nodes.UnknownNode as exc:
            return json_error(404, str(exc))
        except nodes.ClosedSession as exc:
            return json_error(409, str(exc))

    return wrapper


@node_endpoint
def register(request, body):
    node = nodes.register_node(Registration.parse(body))
    return JsonResponse(
        {
            "name": node.name,
            "state": node.state,
            "session": node.session,
            "heartbeat_interval_s": settings.LIFELINE_HEARTBEAT_INTERVAL_S,
            "heartbeat_miss_s": settings.LIFELINE_HEARTBEAT_MISS_S,
        }
    )


@node_endpoint
def heartbeat(request, body, name):
    state = nodes.record_heartbeat(name, Heartbeat.parse(body))
    return JsonResponse({"name": name, "state": state})


@node_endpoint
def deregister(request, body, name):
    if not isinstance(body, dict) or not isinstance(body.get("session"), str):
        raise ProtocolError("session", "is required")
    reason = str(body.get("reason") or "no reason given")[:200]
    node = nodes.deregister_node(name, body["session"], reason)
    return JsonResponse({"name": node.name, "state": node.state})
