"""The OpenAPI 3 documents of Lifeline's HTTP surfaces, served at `/api/schema`.

`document()` is the console's JSON API (`/api/...`, a user's API token); `?surface=gateway` is the gateway's
OpenAI-compatible surface, which every node serves too (`gateway_document()`); `?surface=node` the node agent's
control endpoints (`node_document()`, the agent token). They are written by hand where a reader needs the words, and
built from the forms, choices and constants that decide what a view accepts wherever one exists, so a field added
there is a field here. tests/console/test_api_schema.py fails when a route of console/urls.py (or a method it answers)
is missing from the document, or the document names one the URLs do not have.
"""

import copy

from django import forms

from console.forms import DrainRequestForm
from console.readmodels import cluster as cluster_model
from console.readmodels import reports as report_model
from console.views import drains as drain_views
from console.views import incidents as incident_views
from recovery.choices import IncidentSeverity, IncidentStatus
from recovery.forms import MODEL_RANGES, SettingsForm, SloObjectiveForm
from recovery.models import DrainDecision
from workers import faults, openai_schema
from workers.protocol import MODEL_STATES, NETWORKS

VERSION = "1"
JSON = "application/json"
SURFACES = ("console", "gateway", "node")


# --- small builders ----------------------------------------------------------------------------------------------
def _obj(properties: dict | None = None, required=(), extra: bool = True) -> dict:
    schema: dict = {"type": "object", "properties": properties or {}}
    if required:
        schema["required"] = list(required)
    if not extra:
        schema["additionalProperties"] = False
    return schema


def _typed(required: bool = True, **fields: str) -> dict:
    """An object of named fields, each of a JSON type (`"number?"`: a number or null), all of them required."""
    properties = {}
    for name, kind in fields.items():
        schema = {"type": kind.rstrip("?")}
        properties[name] = _nullable(schema) if kind.endswith("?") else schema
    return _obj(properties, list(fields) if required else ())


def _array(items: dict | None = None) -> dict:
    return {"type": "array", "items": items or {}}


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {JSON: {"schema": schema}}}


def _error(description: str) -> dict:
    return {"description": description, "content": {JSON: {"schema": {"$ref": "#/components/schemas/Error"}}}}


def _path_param(name: str, kind: str = "string", description: str = "", **extra) -> dict:
    return {"name": name, "in": "path", "required": True, "description": description, "schema": {"type": kind, **extra}}


def _query(name: str, schema: dict, description: str) -> dict:
    return {"name": name, "in": "query", "required": False, "description": description, "schema": schema}


def _form_field(field: forms.Field) -> dict:
    """A Django form field as a JSON Schema: what the view's form accepts from a JSON body."""
    if isinstance(field, forms.TypedChoiceField | forms.ChoiceField) and field.choices:
        values = [value for value, _ in field.choices if value != ""]
        return {"type": "string", "enum": values}
    if isinstance(field, forms.BooleanField):
        return {"type": "boolean"}
    if isinstance(field, forms.FloatField | forms.DecimalField):  # before IntegerField: FloatField is one
        schema = {"type": "number"}
    elif isinstance(field, forms.IntegerField):
        schema = {"type": "integer"}
    else:
        schema = {"type": "string"}
        if getattr(field, "max_length", None):
            schema["maxLength"] = field.max_length
        return schema
    if field.min_value is not None:
        schema["minimum"] = field.min_value
    if field.max_value is not None:
        schema["maximum"] = field.max_value
    return schema


def _form_schema(form_class, required: bool = True) -> dict:
    fields = form_class.base_fields
    return _obj(
        {name: _form_field(field) for name, field in fields.items()},
        [name for name, field in fields.items() if field.required and required],
    )


# --- the console -------------------------------------------------------------------------------------------------
ERROR = _obj(
    {
        "error": _obj(
            {
                "status": {"type": "integer"},
                "message": {"type": "string", "description": "what was wrong and what to do"},
                "field": {"type": "string", "description": "the field at fault, where one is"},
                "param": {"type": "string", "description": "the query parameter at fault, where one is"},
            },
            ["message"],
        )
    },
    ["error"],
)
STANDARD_ERRORS = {
    "401": _error("No API token, or an unknown or revoked one."),
    "403": _error("The token's user has no Lifeline role, or not one that may do this."),
}
NOT_ALLOWED = {"405": _error("The route does not answer this method.")}


def _operation(summary: str, responses: dict, *, parameters=(), body: dict | None = None, security=None) -> dict:
    operation: dict = {"summary": summary, "responses": {**responses, **STANDARD_ERRORS}}
    if parameters:
        operation["parameters"] = list(parameters)
    if body is not None:
        operation["requestBody"] = {"required": False, "content": {JSON: {"schema": body}}}
    if security is not None:
        operation["security"] = security
    return operation


INCIDENT = _obj(
    {
        "id": {"type": "integer"},
        "status": {"type": "string", "enum": list(IncidentStatus.values)},
        "severity": {"type": "string", "enum": list(IncidentSeverity.values)},
        "title": {"type": "string"},
        "opened_at": {"type": "number", "description": "epoch seconds"},
    },
    ["id", "status", "severity", "title", "opened_at"],
)
INCIDENT_DETAIL = {
    "allOf": [
        INCIDENT,
        _typed(
            detected_at="number?",
            recovered_at="number?",
            closed_at="number?",
            nodes="array",
            drains="array",
            events="array",
            requests="array",
            figures="object",
        ),
    ]
}
NODE_HEALTH = _typed(
    health="string",
    weight="number",
    breaker="string",
    breaker_failures="integer",
    spare="boolean",
    canary_failures="integer",
    canaries="array",
    xids="array",
    transitions="array",
    drains="array",
)
DRAIN = _obj({"id": {"type": "integer"}, "node": {"type": "string"}, "state": {"type": "string"}}, ["id", "state"])
NOTIFICATION = _obj(
    {
        **_typed(id="integer", at="number", kind="string", title="string", body="string", url="string")["properties"],
        "delivery": {"type": "object", "additionalProperties": {"type": "string"}},
        "gave_up": _array({"type": "string", "enum": ["webhook", "email", "personal"]}),
    },
    ["id", "at", "kind", "title", "delivery", "gave_up"],
)
PROPOSAL = _typed(
    id="integer",
    state="string",
    reason="string",
    model="string",
    switches="array",
    manual="array",
    approvals="array",
    approvals_required="integer",
    approvals_why="string",
    outcome="string",
    drains="array",
    capacity_rps="object",
)
MOE_NAME = _path_param("name", description="the MoE deployment's name", pattern=r"^[-A-Za-z0-9_]{1,64}$")
EW_NAME = _path_param("ew", description="the expert worker's name", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
NODE_NAME = _path_param("name", description="the node's name", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


def _settings_body() -> dict:
    schema = _form_schema(SettingsForm, required=False)
    schema["properties"]["reason"] = {"type": "string", "description": "why, for the audit log"}
    schema["additionalProperties"] = False  # an unknown setting is refused, by name
    schema["properties"]["models"] = {
        "type": "object",
        "description": "per served model, its capacity objective: {model: {field: value}}",
        "additionalProperties": _obj(
            {
                name: {"type": "number", "minimum": low, "maximum": high}
                for name, (low, high, _) in MODEL_RANGES.items()
            },
            extra=False,
        ),
    }
    return schema


def _settings_values() -> dict:
    """What GET /api/settings answers: every setting with its type, and each served model's capacity objective."""
    fields = SettingsForm.base_fields
    properties = {}
    for name, field in fields.items():
        schema = _form_field(field)
        properties[name] = {key: schema[key] for key in ("type", "enum") if key in schema}
    properties["models"] = {"type": "object", "additionalProperties": {"type": "object"}}
    return _obj(properties, list(properties))


def _slo_body() -> dict:
    schema = _form_schema(SloObjectiveForm, required=False)
    schema["properties"]["reason"] = {"type": "string", "description": "why, for the audit log"}
    schema["additionalProperties"] = False  # an unknown field is refused, by name
    return schema


def _drain_body() -> dict:
    schema = _form_schema(DrainRequestForm)
    schema["properties"]["node"] = {"type": "string", "description": "the node to drain"}
    schema["required"] = ["node", *schema.get("required", [])]
    return schema


def _node_routes() -> dict:
    """The node protocol's side on the control plane (recovery/urls.py): a node's own token, not a user's."""
    node_token = [{"nodeToken": []}]
    responses = {
        "400": _error("The message does not follow the node protocol: `field` names what is wrong."),
        "404": _error("No such node: register first."),
        "409": _error("The session is not the node's current one."),
        "503": _error("The control plane has no node token set."),
    }
    registration = _obj(
        {
            "name": {"type": "string"},
            "session": {"type": "string", "minLength": 8, "maxLength": 64},
            "address": {"type": "string", "description": "the agent's base URL, e.g. http://10.0.0.7:8201"},
            "rack": {"type": "string"},
            "model": {"type": "string"},
            "gpu": {"type": "string"},
            "tp": {"type": "integer", "enum": [1, 2, 4, 8]},
            "gpus": _array(_obj({"index": {"type": "integer"}, "uuid": {"type": "string"}})),
            "pid": {"type": "integer"},
            "host": {"type": "string"},
            "engine": {"type": "string"},
            "capabilities": _array({"type": "string"}),
            "spare": {"type": "boolean"},
            "server": {"type": "string"},
            "nvl_domain": {"type": "string"},
            "network": {"type": "string", "enum": list(NETWORKS)},
            "version": {"type": "integer"},
        },
        ["name", "session", "address", "rack", "model", "gpu", "tp", "gpus", "pid", "host"],
    )
    heartbeat = _obj(
        {
            "session": {"type": "string"},
            "model_state": {"type": "string", "enum": list(MODEL_STATES)},
            "load": {"type": "object"},
            "checkpoints": {"type": "object"},
            "xids": _array({"type": "object"}),
            "gpus": _array({"type": "object"}),
        },
        ["session"],
    )
    state = _obj({"name": {"type": "string"}, "state": {"type": "string"}}, ["name", "state"])
    return {
        "/api/nodes/register": {
            "post": _operation(
                "A node introduces itself (at start, and whenever the control plane forgets it).",
                {"200": _json(state, "Registered."), **responses},
                body=registration,
                security=node_token,
            )
        },
        "/api/nodes/{name}/heartbeat": {
            "parameters": [NODE_NAME],
            "post": _operation(
                "A node's heartbeat: its load, the checkpoints it holds, recent Xid events, a reading per GPU.",
                {"200": _json(state, "Recorded."), **responses},
                body=heartbeat,
                security=node_token,
            ),
        },
        "/api/nodes/{name}/deregister": {
            "parameters": [NODE_NAME],
            "post": _operation(
                "A node leaves (a clean shutdown).",
                {"200": _json(state, "Deregistered."), **responses},
                body=_obj({"session": {"type": "string"}, "reason": {"type": "string"}}, ["session"]),
                security=node_token,
            ),
        },
    }


def document() -> dict:
    """The console's JSON API."""
    minutes = cluster_model.SERIES_MINUTES
    incident_id = _path_param("incident_id", "integer", minimum=0, description="the incident's id")
    drain_id = _path_param("drain_id", "integer", minimum=0, description="the drain's id")
    proposal_id = _path_param("proposal_id", "integer", minimum=0, description="the re-placement's id")
    objective_id = _path_param("objective_id", "integer", minimum=0, description="the objective's id")
    paths = {
        "/api/schema": {
            "get": {
                "summary": "This document (anonymous). `?surface=gateway` or `node` for the others.",
                "security": [],
                "parameters": [_query("surface", {"type": "string", "enum": list(SURFACES)}, "which document")],
                "responses": {
                    "200": _json({"type": "object", "required": ["openapi", "paths"]}, "An OpenAPI 3 document."),
                    "400": _error("`surface` is not one of the documents."),
                    **NOT_ALLOWED,
                },
            }
        },
        "/api/cluster": {
            "get": _operation(
                "The live cluster: summary, racks and node cards, the routing table's view.",
                {
                    "200": _json(
                        _obj(
                            {
                                "cluster": {"type": "string"},
                                "generated_at": {"type": "number"},
                                "live": {"type": "boolean"},
                                "heartbeat_miss_s": {"type": "number"},
                                "summary": {"type": "object"},
                                "racks": _array(_obj({"name": {"type": "string"}, "nodes": _array()})),
                                "nodes": _array(_obj({"name": {"type": "string"}}, ["name"])),
                            },
                            ["cluster", "generated_at", "summary", "racks", "nodes"],
                        ),
                        "The cluster now.",
                    ),
                    **NOT_ALLOWED,
                },
            )
        },
        "/api/cluster/series": {
            "get": _operation(
                "The cluster page's charts, per model and tier.",
                {
                    "200": _json(
                        _typed(
                            generated_at="number",
                            minutes="integer",
                            bucket_s="integer",
                            t="array",
                            series="array",
                            requests="integer",
                            truncated="boolean",
                        ),
                        "TTFT and TPOT p50/p99, tokens/s, error and shed shares, per model and tier.",
                    ),
                    "400": _error("`minutes` is not one of the windows."),
                    **NOT_ALLOWED,
                },
                parameters=[_query("minutes", {"type": "integer", "enum": list(minutes)}, "the window")],
            )
        },
        "/api/incidents": {
            "get": _operation(
                "The incidents, newest first, filtered, with their totals.",
                {
                    "200": _json(
                        _obj({"incidents": _array(INCIDENT), "totals": {"type": "object"}}, ["incidents", "totals"]),
                        "The incidents.",
                    ),
                    "400": _error("A filter is malformed: `param` names it."),
                    **NOT_ALLOWED,
                },
                parameters=[
                    _query(
                        "limit",
                        {"type": "integer", "minimum": 1, "maximum": incident_views.MAX_LIMIT},
                        "at most this many",
                    ),
                    _query("status", {"type": "string", "enum": list(IncidentStatus.values)}, "status"),
                    _query("severity", {"type": "string", "enum": list(IncidentSeverity.values)}, "severity"),
                    _query("node", {"type": "string"}, "a node involved"),
                    _query("since", {"type": "string", "format": "date-time"}, "first symptom from (UTC)"),
                    _query("until", {"type": "string", "format": "date-time"}, "first symptom to (UTC)"),
                ],
            )
        },
        "/api/incidents/{incident_id}": {
            "parameters": [incident_id],
            "get": _operation(
                "One incident with its timeline to the millisecond.",
                {"200": _json(INCIDENT_DETAIL, "The incident."), "404": _error("No such incident."), **NOT_ALLOWED},
            ),
        },
        "/api/prometheus/targets": {
            "get": _operation(
                "Prometheus's HTTP service discovery (http_sd_configs) of the nodes: a target group per node that has "
                "not left the fleet, its agent's address (it serves /metrics) and its labels.",
                {
                    "200": _json(
                        _array(
                            _obj(
                                {
                                    "targets": _array({"type": "string"}),
                                    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                                },
                                ["targets", "labels"],
                            )
                        ),
                        "The target groups, one per node.",
                    ),
                    **NOT_ALLOWED,
                },
            )
        },
        "/api/alerts/alertmanager": {
            "post": _operation(
                "Alertmanager's webhook receiver (operator, on-call token): a group's alerts open or join an incident, "
                "add to its timeline, attach to the node they name, and resolve it when they resolve.",
                {
                    "200": _json(
                        _obj(
                            {
                                "incident": _nullable({"type": "integer"}),
                                "opened": {"type": "boolean"},
                                "status": {"type": "string"},
                                "alerts": _array(
                                    _obj(
                                        {
                                            "name": {"type": "string"},
                                            "status": {"type": "string", "enum": ["firing", "resolved"]},
                                            "node": _nullable({"type": "string"}),
                                            "links": {"type": "object", "additionalProperties": {"type": "string"}},
                                        },
                                        ["name", "status", "node", "links"],
                                    )
                                ),
                            },
                            ["incident", "opened", "alerts"],
                        ),
                        "Taken: the incident and each alert with the pages that explain it (incident null: only "
                        "resolutions of alerts never seen firing).",
                    ),
                    "400": _error("Not Alertmanager's webhook notification (version 4): `field` names what is wrong."),
                    **NOT_ALLOWED,
                },
                body=_obj(
                    {
                        "version": {"type": "string", "enum": ["4"]},
                        "groupKey": {"type": "string"},
                        "status": {"type": "string"},
                        "receiver": {"type": "string"},
                        "externalURL": {"type": "string"},
                        "alerts": _array(
                            _obj(
                                {
                                    "status": {"type": "string", "enum": ["firing", "resolved"]},
                                    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                                    "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
                                    "startsAt": {"type": "string", "format": "date-time"},
                                    "endsAt": {"type": "string", "format": "date-time"},
                                    "generatorURL": {"type": "string"},
                                    "fingerprint": {"type": "string"},
                                },
                                ["status", "labels", "startsAt"],
                            )
                        ),
                    },
                    ["version", "groupKey", "alerts"],
                ),
            ),
        },
        "/api/checkpoints": {
            "get": _operation(
                "The checkpoint distribution: which node holds whose KV pages, within which budget.",
                {
                    "200": _json(
                        _typed(
                            policy="string",
                            generated_at="number",
                            nodes="array",
                            matrix="object",
                            bytes_held="object",
                            in_flight="integer",
                            covered="integer",
                            coverage="number?",
                            holders="array",
                        ),
                        "The distribution.",
                    ),
                    **NOT_ALLOWED,
                },
            )
        },
        "/api/nodes/{name}/faults": {
            "parameters": [NODE_NAME],
            "post": _operation(
                "Inject a fault on a staging node (operator; the cluster must allow fault injection).",
                {
                    "200": _json({"type": "object"}, "The node's answer."),
                    "202": _json({"type": "object"}, "A crash or hang, landing."),
                    "400": _error("The body or a fault parameter is wrong: `field` names it."),
                    "404": _error("No such node."),
                    "409": _error("Fault injection is off for this cluster."),
                    "502": _error("The node did not answer."),
                    **NOT_ALLOWED,
                },
                body=_obj(
                    {
                        "kind": {"type": "string", "enum": list(faults.KINDS)},
                        "reason": {"type": "string"},
                    },
                    ["kind"],
                ),
            ),
        },
        "/api/nodes/{name}/migrate": {
            "parameters": [NODE_NAME],
            "post": _operation(
                "Move every request off a node (live migration), cordoning it first unless told not to.",
                {
                    "202": _json(
                        _obj({"command": {"type": "string"}, "status_url": {"type": "string"}}, ["command"]),
                        "Started; follow it at `status_url`.",
                    ),
                    "400": _error("The body is not JSON."),
                    "404": _error("No such node."),
                    **NOT_ALLOWED,
                },
                body=_obj({"reason": {"type": "string"}, "cordon": {"type": "boolean"}}),
            ),
        },
        "/api/nodes/{name}/health": {
            "parameters": [NODE_NAME],
            "get": _operation(
                "A node's health: state, canary results, telemetry and the reasons.",
                {"200": _json(NODE_HEALTH, "The node's health."), "404": _error("No such node."), **NOT_ALLOWED},
            ),
        },
        "/api/migrations/{command}": {
            "parameters": [_path_param("command", description="the id a migrate call returned", pattern=r"^[^/]+$")],
            "get": _operation(
                "A live migration's progress.",
                {
                    "200": _json({"type": "object"}, "Where it stands."),
                    "404": _error("No such migration (kept an hour)."),
                    **NOT_ALLOWED,
                },
            ),
        },
        "/api/drains": {
            "get": _operation(
                "The drains, newest first.",
                {"200": _json(_obj({"drains": _array(DRAIN)}, ["drains"]), "The drains."), **NOT_ALLOWED},
            ),
            "post": _operation(
                "Request a drain of a node (operator, on-call); on-call approves it.",
                {
                    "201": _json(DRAIN, "Requested."),
                    "400": _error("The body or a field is wrong: `field` names it."),
                    "404": _error("No such node."),
                    "409": _error("The node cannot be drained now (say, one is under way)."),
                    **NOT_ALLOWED,
                },
                body=_drain_body(),
            ),
        },
        "/api/drains/{drain_id}": {
            "parameters": [drain_id],
            "get": _operation(
                "One drain, live.",
                {"200": _json(DRAIN, "The drain."), "404": _error("No such drain."), **NOT_ALLOWED},
            ),
        },
        "/api/drains/{drain_id}/{decision}": {
            "parameters": [
                drain_id,
                _path_param(
                    "decision",
                    description="approve or reject (on-call), or cancel: withdraw it while it waits (its requester's "
                    "side: operator, oncall or admin; one the health machine raised, oncall or admin)",
                    enum=[DrainDecision.APPROVE, DrainDecision.REJECT, "cancel"],
                ),
            ],
            "post": _operation(
                "Approve, reject or withdraw a drain, with a reason.",
                {
                    "200": _json(DRAIN, "Decided."),
                    "400": _error("The body is not JSON."),
                    "404": _error("No such drain, or not a decision."),
                    "409": _error("The drain is no longer waiting for a decision."),
                    **NOT_ALLOWED,
                },
                body=_obj({"reason": {"type": "string"}}),
            ),
        },
        "/api/notifications": {
            "get": _operation(
                "The latest on-call notifications and how each channel's delivery went; undelivered=1: the dead "
                "letters, a channel that gave up after every try.",
                {
                    "200": _json(_obj({"notifications": _array(NOTIFICATION)}, ["notifications"]), "Newest first."),
                    "400": _error("A filter is malformed: `param` names it."),
                    **NOT_ALLOWED,
                },
                parameters=[
                    _query(
                        "limit",
                        {"type": "integer", "minimum": 1, "maximum": drain_views.MAX_NOTIFICATIONS},
                        "at most this many (50)",
                    ),
                    _query("undelivered", {"type": "string", "enum": ["0", "1"]}, "1: the dead letters only"),
                ],
            )
        },
        "/api/notifications/{notification_id}/resend": {
            "parameters": [_path_param("notification_id", "integer", minimum=0, description="the notification's id")],
            "post": _operation(
                "Send a dead letter's channel again (on-call, admin), audited: queued for the worker.",
                {
                    "202": _json(
                        _typed(id="integer", channel="string", delivery="string"), "Queued again: sent after commit."
                    ),
                    "400": _error("The body is not JSON, or the channel is not webhook or email: `field` names it."),
                    "404": _error("No such notification."),
                    "409": _error("That channel did not give up: nothing to send again."),
                    **NOT_ALLOWED,
                },
                body=_obj(
                    {"channel": {"type": "string", "enum": ["webhook", "email"]}, "reason": {"type": "string"}},
                    ["channel"],
                ),
            ),
        },
        "/api/degradation": {
            "get": _operation(
                "The degradation level, its history and the capacity report behind it.",
                {
                    "200": _json(
                        _typed(
                            level="integer",
                            badge="string",
                            batch_factor="number",
                            shed_tiers="array",
                            accept_new="boolean",
                            latency_slo_factor="number",
                            history="array",
                            report="object",
                        ),
                        "The level now.",
                    ),
                    **NOT_ALLOWED,
                },
            )
        },
        "/api/moe/{name}": {
            "get": _operation(
                "An MoE deployment as the control plane keeps it (recovery.actions.moe): its expert workers (state, "
                "experts and shadows in the table, memory, tokens served), the expert routing table as a heatmap "
                "(logical expert × EW: 2 primary, 1 shadow), tokens per expert, balancedness over time, and the table "
                "version each attention worker took.",
                {
                    "200": _json(
                        _typed(
                            name="string",
                            model="string",
                            version="integer",
                            ews="array",
                            ew_names="array",
                            heatmap="array",
                            attention_workers="array",
                            tokens_per_expert="array",
                            balancedness="object",
                            shadow_bytes="integer",
                            shadow_coverage="number",
                        ),
                        "The deployment now.",
                    ),
                    "404": _error("No MoE deployment has that name."),
                    **NOT_ALLOWED,
                },
                parameters=[MOE_NAME],
            )
        },
        "/api/moe/{name}/ews/{ew}/faults": {
            "post": _operation(
                "Inject a fault on one expert worker of an MoE deployment (operator; the cluster must allow fault "
                "injection): corrupt (silent corruption, found by its canaries), hang (found by the attention "
                "workers' data-path probes), or null to clear it. Audited.",
                {
                    "200": _json(_typed(corrupt="boolean", hung="boolean"), "The expert worker's answer."),
                    "400": _error("The body or the kind is wrong: `field` names it."),
                    "404": _error("No such expert worker in a deployment of that name."),
                    "502": _error("The expert worker did not answer."),
                    **NOT_ALLOWED,
                },
                parameters=[MOE_NAME, EW_NAME],
                body=_obj(
                    {
                        "kind": _nullable({"type": "string", "enum": ["corrupt", "hang"]}),
                        "reason": {"type": "string"},
                    },
                    ["kind"],
                ),
            )
        },
        "/api/placement/plan": {
            "post": _operation(
                "A placement plan for the live fleet (or a what-if of it) beside the current placement, each judged by "
                "the simulator; the moves and their cost. Changes nothing.",
                {
                    "200": _json(
                        _typed(
                            generated_at="string",
                            what_if="object",
                            demands="array",
                            current="object",
                            proposed="object",
                            moves="array",
                            cost="object",
                            solver="object",
                            problems="array",
                        ),
                        "The plan; `evaluation` (simulated figures per model) unless `evaluate` was false.",
                    ),
                    "400": _error("A what-if is wrong, or no node serves yet: `field` names it."),
                    **NOT_ALLOWED,
                },
                body=_obj(
                    {
                        "add": _obj(
                            {
                                "gpu": {"type": "string"},
                                "count": {"type": "integer", "minimum": 1, "maximum": 256},
                                "gpus": {"type": "integer", "enum": [1, 2, 4, 8]},
                                "rack": {"type": "string"},
                            }
                        ),
                        "lose_racks": _array({"type": "string"}),
                        "evaluate": {"type": "boolean"},
                    }
                ),
            )
        },
        "/api/placement/proposals": {
            "get": _operation(
                "The latest re-placement proposals, newest first.",
                {"200": _json(_obj({"proposals": _array(PROPOSAL)}, ["proposals"]), "The proposals."), **NOT_ALLOWED},
            ),
            "post": _operation(
                "Ask for a re-placement of the live fleet (operator, on-call): the planner's plan as node switches, "
                "waiting for on-call.",
                {
                    "201": _json(PROPOSAL, "Proposed."),
                    "400": _error("The body is not JSON, or no node serves yet."),
                    "409": _error("Another is open, or the plan switches no node: the message says which."),
                    **NOT_ALLOWED,
                },
                body=_obj({"reason": {"type": "string"}}),
            ),
        },
        "/api/placement/proposals/{proposal_id}": {
            "parameters": [proposal_id],
            "get": _operation(
                "One re-placement, with its switches' drains.",
                {"200": _json(PROPOSAL, "The proposal."), "404": _error("No such proposal."), **NOT_ALLOWED},
            ),
        },
        "/api/placement/proposals/{proposal_id}/{decision}": {
            "parameters": [
                proposal_id,
                _path_param("decision", description="approve or reject", enum=["approve", "reject"]),
            ],
            "post": _operation(
                "Approve or reject a re-placement (on-call), with a reason. The last approval checks that the fleet "
                "is the one the plan was made against, and starts its switches.",
                {
                    "200": _json(PROPOSAL, "Decided."),
                    "400": _error("The body is not JSON."),
                    "404": _error("No such proposal, or not a decision."),
                    "409": _error("Not waiting for a decision, decided twice, or refused: the fleet changed."),
                    **NOT_ALLOWED,
                },
                body=_obj({"reason": {"type": "string"}}),
            ),
        },
        "/api/settings": {
            "get": _operation(
                "The cluster's operating settings (admin).",
                {"200": _json(_settings_values(), "The settings."), **NOT_ALLOWED},
            ),
            "patch": _operation(
                "Change some settings (admin), validated and audited as on the page.",
                {
                    "200": _json(_obj({"changed": _array({"type": "string"})}, ["changed"]), "Saved."),
                    "400": _error("A value is out of range or malformed: `field` names it."),
                    **NOT_ALLOWED,
                },
                body=_settings_body(),
            ),
        },
        "/api/slo": {
            "get": _operation(
                "The service-level objectives with their budgets.",
                {
                    "200": _json(
                        _obj(
                            {"objectives": _array(), "profile": {"type": "string"}, "rollup": {"type": "object"}},
                            ["objectives"],
                        ),
                        "The objectives.",
                    ),
                    **NOT_ALLOWED,
                },
            )
        },
        "/api/slo/{objective_id}": {
            "parameters": [objective_id],
            "get": _operation(
                "One objective over its window, with its days.",
                {
                    "200": _json({"type": "object"}, "The objective."),
                    "404": _error("No such objective."),
                    **NOT_ALLOWED,
                },
            ),
            "patch": _operation(
                "Change an objective's figures (admin), validated and audited.",
                {
                    "200": _json(_obj({"changed": _array({"type": "string"})}, ["changed"]), "Saved."),
                    "400": _error("A value is malformed: `field` names it."),
                    "404": _error("No such objective."),
                    **NOT_ALLOWED,
                },
                body=_slo_body(),
            ),
        },
        "/api/reports": {
            "get": _operation(
                "An SLA report for a period, in JSON, CSV or PDF.",
                {
                    "200": {
                        "description": "The report.",
                        "content": {
                            JSON: {"schema": {"type": "object"}},
                            "text/csv": {"schema": {"type": "string"}},
                            "application/pdf": {"schema": {"type": "string", "format": "binary"}},
                        },
                    },
                    "400": _error("A parameter is wrong: `field` names it."),
                    **NOT_ALLOWED,
                },
                parameters=[
                    _query("period", {"type": "string", "enum": list(report_model.PERIODS)}, "the period"),
                    _query("start", {"type": "string", "format": "date"}, "first day (custom)"),
                    _query("end", {"type": "string", "format": "date"}, "last day (custom)"),
                    _query("tenant", {"type": "string", "enum": ["0", "1"]}, "a row per tenant"),
                    _query("format", {"type": "string", "enum": ["json", "csv", "pdf"]}, "the format"),
                ],
            )
        },
        **_node_routes(),
    }
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "Lifeline console API",
            "version": VERSION,
            "description": "The console's JSON API. Send `Authorization: Bearer <API token>` "
            "(`python manage.py issue_token USER`); the role of the token's user decides what it may do. Every "
            "refusal is JSON: `{error: {status, message, field?}}`.",
        },
        "paths": paths,
        "components": {
            "schemas": {"Error": ERROR},
            "securitySchemes": {
                "apiToken": {"type": "http", "scheme": "bearer", "description": "a user's API token"},
                "nodeToken": {"type": "http", "scheme": "bearer", "description": "the cluster's node token"},
            },
        },
        "security": [{"apiToken": []}],
    }


# --- the OpenAI-compatible surface: the gateway, and every node -----------------------------------------------------
OPENAI_ERROR = _obj(
    {
        "error": _obj(
            {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": _nullable({"type": "string"}),
                "code": _nullable({"type": "string"}),
            },
            ["message", "type"],
        )
    },
    ["error"],
)
PEER = _obj(
    {"name": {"type": "string"}, "address": {"type": "string"}, "rack": {"type": "string"}},
    ["name", "address"],
)
LIFELINE_EXTENSION = _obj(
    {
        "request_id": {"type": "string", "pattern": openai_schema.REQUEST_ID.pattern},
        "holders": {**_array({"$ref": "#/components/schemas/Peer"}), "maxItems": 2},
        "checkpoint_prefill_chunks": {"type": "boolean"},
        "resume": _obj(
            {
                "generated_token_ids": _array({"type": "integer", "minimum": 0}),
                "sources": _array({"$ref": "#/components/schemas/Peer"}),
            },
            ["generated_token_ids"],
        ),
        "return_token_ids": {"type": "boolean"},
        "attach": {"type": "integer", "minimum": 0},
    },
    extra=False,
)
_SAMPLING = {
    "model": {"type": "string"},
    "max_tokens": _nullable({"type": "integer", "minimum": 1}),
    "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 2}),
    "top_p": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
    "seed": _nullable({"type": "integer"}),
    "stop": _nullable(
        {"anyOf": [{"type": "string"}, {**_array({"type": "string"}), "maxItems": openai_schema.MAX_STOP}]}
    ),
    "stream": _nullable({"type": "boolean"}),
    "stream_options": _nullable(_obj({"include_usage": {"type": "boolean"}})),
    "n": _nullable({"type": "integer", "enum": [1]}),
    "user": {"type": "string"},
    "lifeline": {"$ref": "#/components/schemas/LifelineExtension"},
}
COMPLETION_REQUEST = _obj(
    {
        **_SAMPLING,
        "prompt": {"anyOf": [{"type": "string"}, _array({"type": "string"}), _array({"type": "integer"})]},
        "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": openai_schema.MAX_COMPLETION_LOGPROBS}),
        "echo": {"type": "boolean"},
    },
    ["model"],
)
CHAT_REQUEST = _obj(
    {
        **_SAMPLING,
        "messages": {
            **_array(
                _obj(
                    {
                        "role": {"type": "string", "enum": list(openai_schema.ROLES)},
                        "content": {"anyOf": [{"type": "string"}, _array({"type": "object"}), {"type": "null"}]},
                    },
                    ["role"],
                )
            ),
            "minItems": 1,
        },
        "logprobs": _nullable({"type": "boolean"}),
        "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": openai_schema.MAX_TOP_LOGPROBS}),
        "max_completion_tokens": _nullable({"type": "integer", "minimum": 1}),
    },
    ["model", "messages"],
)
COMPLETION = _obj(
    {
        "id": {"type": "string"},
        "object": {"type": "string"},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": _array(_obj({"index": {"type": "integer"}, "finish_reason": _nullable({"type": "string"})})),
        "usage": _obj(
            {
                "prompt_tokens": {"type": "integer"},
                "completion_tokens": {"type": "integer"},
                "total_tokens": {"type": "integer"},
            }
        ),
    },
    ["id", "object", "model", "choices"],
)


def _openai_operation(summary: str, body_ref: str) -> dict:
    refusal = {"content": {JSON: {"schema": {"$ref": "#/components/schemas/OpenAIError"}}}}
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": {JSON: {"schema": {"$ref": body_ref}}}},
        "responses": {
            "200": {
                "description": "The completion, whole (JSON) or streamed (server-sent events).",
                "content": {
                    JSON: {"schema": {"$ref": "#/components/schemas/Completion"}},
                    "text/event-stream": {"schema": {"type": "string"}},
                },
            },
            "400": {"description": "A field is wrong or unsupported: `param` names it.", **refusal},
            "401": {"description": "The API key (gateway) or the agent token (lifeline.holders, resume).", **refusal},
            "404": {"description": "The model is not served here.", **refusal},
            "413": {"description": "The body is too large.", **refusal},
            "415": {"description": "The body is not JSON.", **refusal},
            "429": {"description": "Shed under load, or over a rate limit.", **refusal},
            "501": {"description": "The engine behind this node cannot do what was asked.", **refusal},
            "503": {"description": "No capacity now (degradation level 4, or no node serves the model).", **refusal},
        },
    }


def gateway_document() -> dict:
    """The OpenAI-compatible surface the gateway serves under /v1, and every node agent too. Lifeline's own protocol
    travels in the request's `lifeline` object; tests also fuzz this surface with OpenAI's own document."""
    return {
        "openapi": "3.0.3",
        "info": {"title": "Lifeline OpenAI-compatible API", "version": VERSION},
        "paths": {
            "/v1/completions": {
                "post": _openai_operation("A text completion.", "#/components/schemas/CompletionRequest")
            },
            "/v1/chat/completions": {
                "post": _openai_operation("A chat completion.", "#/components/schemas/ChatCompletionRequest")
            },
            "/v1/models": {
                "get": {
                    "summary": "The models served.",
                    "responses": {
                        "200": _json(
                            _obj({"object": {"type": "string"}, "data": _array(_obj({"id": {"type": "string"}}))}),
                            "The models.",
                        )
                    },
                }
            },
        },
        "components": {
            "schemas": {
                "CompletionRequest": COMPLETION_REQUEST,
                "ChatCompletionRequest": CHAT_REQUEST,
                "Completion": COMPLETION,
                "LifelineExtension": LIFELINE_EXTENSION,
                "Peer": PEER,
                "OpenAIError": OPENAI_ERROR,
            },
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"apiKey": []}, {}],
    }


# --- the node agent's control endpoints (workers/control_api.py) -----------------------------------------------------
PAGE = _obj(
    {
        "request_id": {"type": "string"},
        "seq": {"type": "integer", "minimum": 1},
        "block": {"type": "integer", "minimum": 0},
        "tokens": _array({"type": "integer", "minimum": 0}),
        "nbytes": {"type": "integer", "minimum": 0},
        "payload": {"type": "string", "format": "byte"},
        "digest": {"type": "string"},
    },
    ["request_id", "seq", "block", "tokens", "nbytes", "payload", "digest"],
)
COMMIT = _obj(
    {"request_id": {"type": "string"}, "seq": {"type": "integer"}, "tokens": {"type": "integer"}},
    ["request_id", "seq", "tokens"],
)


def _control(summary: str, ok: dict, *, body: dict | None = None, parameters=(), more: dict | None = None) -> dict:
    refusal = {"content": {JSON: {"schema": {"$ref": "#/components/schemas/OpenAIError"}}}}
    operation: dict = {
        "summary": summary,
        "responses": {
            "200": _json(ok, "Done."),
            "400": {"description": "A field is wrong: `param` names it.", **refusal},
            "401": {"description": "The token is missing or wrong.", **refusal},
            "501": {"description": "The engine does not offer this.", **refusal},
            "503": {"description": "Control endpoints are off: no agent token.", **refusal},
            **(more or {}),
        },
    }
    if body is not None:
        operation["requestBody"] = {"required": True, "content": {JSON: {"schema": body}}}
    if parameters:
        operation["parameters"] = list(parameters)
    return operation


def node_document() -> dict:
    refusal = {"content": {JSON: {"schema": {"$ref": "#/components/schemas/OpenAIError"}}}}
    request_id = _path_param("request_id", description="the request's id")
    conflict = {"409": {"description": "Not now: the state does not allow it.", **refusal}}
    missing = {"404": {"description": "No such request or checkpoint here.", **refusal}}
    holders = {**_array(PEER), "maxItems": 2}
    faults_ = [{"faultToken": []}]
    paths = {
        "/agent/kv/batch": {
            "post": _control(
                "Checkpoint pages, commit records and drops from a serving node, in order (this node as holder).",
                _obj(
                    {"accepted": {"type": "integer"}, "refused": _array(), "committed": {"type": "object"}},
                    ["accepted", "refused", "committed"],
                ),
                body=_obj(
                    {
                        "model": {"type": "string"},
                        "source": {"type": "string"},
                        "direct": {"type": "boolean"},
                        "pages": _array(PAGE),
                        "commits": _array(COMMIT),
                        "drops": _array({"type": "string"}),
                    },
                    ["model"],
                ),
            )
        },
        "/agent/kv": {"get": _control("The checkpoints held here.", _obj({"stats": {}, "checkpoints": _array()}))},
        "/agent/kv/{request_id}": {
            "parameters": [request_id],
            "get": _control("One checkpoint held here, with its pages.", {"type": "object"}, more=missing),
            "delete": _control("Drop a checkpoint held here.", _obj({"dropped": {"type": "boolean"}})),
        },
        "/agent/requests/{request_id}/migrate": {
            "parameters": [request_id],
            "post": _control(
                "Stop a request at a token boundary and hand its KV blocks to `target`.",
                {"type": "object"},
                body=_obj({"target": PEER}, ["target"]),
                more={**missing, **conflict, "502": {"description": "The target did not take the blocks.", **refusal}},
            ),
        },
        "/agent/requests/{request_id}/holders": {
            "parameters": [request_id],
            "post": _control(
                "Point a running request's checkpoint at new holders.",
                {"type": "object"},
                body=_obj({"holders": holders}, ["holders"]),
                more={**missing, **conflict},
            ),
        },
        "/agent/assist": {
            "post": _control(
                "Verify a draft-ready node's drafts (speculative assist).",
                {"type": "object"},
                body=_obj({"draft": PEER, "k": {"type": "integer", "minimum": 1, "maximum": 16}}, ["draft"]),
                more=conflict,
            ),
            "delete": _control(
                "End the pairing.",
                {"type": "object"},
                parameters=[_query("draft", {"type": "string"}, "only if this is the draft verified")],
                more=conflict,
            ),
        },
        "/agent/draft": {
            "post": _control(
                "As a draft-ready node: propose k tokens per sequence.",
                _obj({"drafts": _array()}),
                body=_obj(
                    {"model": {"type": "string"}, "k": {"type": "integer"}, "items": _array({"type": "object"})},
                    ["model"],
                ),
                more=conflict,
            )
        },
        "/agent/reload": {
            "post": _control(
                "Reload the model (draft first).", {"type": "object"}, body=_obj({"cold": {"type": "boolean"}})
            )
        },
        "/agent/model": {
            "post": _control(
                "Serve another model: the drained node starts again with it on the same GPUs, loading it cold.",
                _obj({"switching": {"type": "boolean"}, "from": {"type": "string"}, "model": {"type": "string"}}),
                body=_obj({"model": {"type": "string"}}, ["model"]),
                more={
                    **conflict,
                    "202": _json({"type": "object"}, "The switch has begun: the node leaves and starts again."),
                },
            )
        },
        "/agent/ert": {
            "post": _control(
                "As an MoE attention worker: take the control plane's newer expert routing table (document 001).",
                _obj({"version": {"type": "integer"}, "down": _array({"type": "string"})}),
                body=_obj(
                    {
                        "ert": _obj(
                            {"model": {"type": "string"}, "version": {"type": "integer"}, "experts": _array()},
                            ["model", "version", "experts"],
                        ),
                        "addresses": {"type": "object", "additionalProperties": {"type": "string"}},
                    },
                    ["ert"],
                ),
                more={
                    **conflict,
                    "404": _json({"type": "object"}, "The node is not an MoE attention worker."),
                },
            )
        },
        "/agent/reset": {"post": _control("Reset the GPUs.", {"type": "object"})},
        "/agent/config": {
            "get": _control("The batch limit.", {"type": "object"}),
            "post": _control(
                "Lower or restore the batch limit.",
                {"type": "object"},
                body=_obj(
                    {"batch_factor": {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 1}},
                    ["batch_factor"],
                ),
            ),
        },
        "/agent/faults": {
            "get": {**_control("The faults in force.", {"type": "object"}), "security": faults_},
            "post": {
                **_control(
                    "Inject a fault (staging only).",
                    {"type": "object"},
                    body=_obj({"kind": {"type": "string", "enum": list(faults.KINDS)}}, ["kind"]),
                    more={"202": _json({"type": "object"}, "A crash or hang, landing.")},
                ),
                "security": faults_,
            },
            "delete": {
                **_control(
                    "Clear faults (all, or one kind).",
                    {"type": "object"},
                    parameters=[_query("kind", {"type": "string", "enum": list(faults.KINDS)}, "only this kind")],
                ),
                "security": faults_,
            },
        },
    }
    for item in paths.values():
        for method, operation in item.items():
            if method != "parameters":
                operation["responses"].setdefault(
                    "403", {"description": "Fault injection is off on this node.", **refusal}
                )
    return {
        "openapi": "3.0.3",
        "info": {"title": "Lifeline node agent control API", "version": VERSION},
        "paths": paths,
        "components": {
            "schemas": {"OpenAIError": OPENAI_ERROR},
            "securitySchemes": {
                "agentToken": {"type": "http", "scheme": "bearer", "description": "LIFELINE_AGENT_TOKEN"},
                "faultToken": {"type": "http", "scheme": "bearer", "description": "LIFELINE_FAULT_TOKEN"},
            },
        },
        "security": [{"agentToken": []}],
    }


def surface(name: str) -> dict:
    """One document, a copy of its own: the schemas it shares with the others are not for a caller to change."""
    return copy.deepcopy({"console": document, "gateway": gateway_document, "node": node_document}[name]())
