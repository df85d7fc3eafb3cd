"""The node protocol's control-plane side: registration, heartbeats, leaving."""

import functools
import json

from django.conf import settings
from django.http import JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from recovery.actions import nodes
from recovery.http import bearer_token, json_error
from workers.protocol import Heartbeat, ProtocolError, Registration, refuse_nul
from workers.runtime import node_token_name, token_matches


def node_endpoint(view):
    """Nodes authenticate with the cluster's node token, or their own per-node token (which speaks only for its
    node's name), and send JSON bodies."""

    @csrf_exempt
    @require_POST
    @functools.wraps(view)
    def wrapper(request, *args, **kwargs):
        shared = (settings.LIFELINE_NODE_TOKEN, settings.LIFELINE_NODE_TOKEN_PREVIOUS)
        secrets = (settings.LIFELINE_NODE_TOKEN_SECRET, settings.LIFELINE_NODE_TOKEN_SECRET_PREVIOUS)
        if not any(shared) and not any(secrets):
            return json_error(
                503,
                "Neither LIFELINE_NODE_TOKEN nor LIFELINE_NODE_TOKEN_SECRET is set on the control plane, so no node "
                "can register: set one and restart the console.",
            )
        token = bearer_token(request)
        # Every candidate is compared, in constant time each, so timing does not tell a near miss.
        cluster_wide = any([token_matches(token, candidate) for candidate in shared])
        speaks_for = None if cluster_wide else node_token_name(token, secrets)
        if not cluster_wide and speaks_for is None:
            return json_error(
                401,
                "The node token is missing or wrong: start the node with LIFELINE_NODE_TOKEN set to the cluster's "
                "node token, or to its own (`manage.py node_token NAME`).",
            )
        try:
            body = json.loads(request.body or b"null")
        except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past reading
            return json_error(400, "The body is not valid JSON.", field="body")
        if speaks_for is not None:
            # A per-node token speaks for its own node only: the name it registers, beats or leaves as.
            name = kwargs.get("name", body.get("name") if isinstance(body, dict) else None)
            if name != speaks_for:
                return json_error(
                    403,
                    f"This node token belongs to {speaks_for!r}, not to {name!r}: a node speaks only for itself.",
                    field="name",
                )
        try:
            refuse_nul(kwargs)  # the node's name, from the path
            refuse_nul(body)
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
