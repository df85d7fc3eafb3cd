"""schemathesis against the live console: every operation of console/openapi.py's document, with data that follows it
(positive) and data that breaks it (negative), through a real HTTP server and an admin's API token. No answer may be a
server error; each conforms to the document (status code, content type, body); every refusal is JSON that says what
was wrong, and a 400 names the field."""

import datetime as dt
import json
import uuid

import pytest
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from console import openapi
from console.models import ApiToken
from recovery.actions import nodes
from recovery.choices import IncidentSeverity, IncidentStatus
from recovery.models import Incident
from tests.helpers import examples
from workers.protocol import Registration

FUZZ_EXAMPLES = examples(40)  # per operation and mode: about 40 s for the whole document in `full`
NODE_TOKEN = "fuzz-node-token"
NODE = "fz-a"


def _register(name: str):
    """A node whose agent address is loopback's discard port: what the console asks of it is refused at once, and
    nothing leaves the machine."""
    return nodes.register_node(
        Registration.parse(
            {
                "name": name,
                "session": uuid.uuid4().hex,
                "address": "http://127.0.0.1:9",
                "rack": "rack-a",
                "model": "Qwen3-32B",
                "gpu": "H200-SXM",
                "tp": 1,
                "pid": 4242,
                "host": "h",
                "gpus": [{"index": 0, "uuid": f"GPU-{name}-0", "name": "NVIDIA H200", "memory_bytes": 141 * 10**9}],
            }
        )
    )


@pytest.fixture
def fleet(transactional_db, cast, settings):
    """For the live server, which reads the database from its own thread: committed rows."""
    return _fleet(cast, settings)


@pytest.fixture
def fleet_in_a_transaction(db, cast, settings):
    return _fleet(cast, settings)


def _fleet(cast, settings) -> dict:
    settings.LIFELINE_NODE_TOKEN = NODE_TOKEN
    node = _register(NODE)
    incident = Incident.objects.create(
        cluster=node.cluster,
        title=f"{NODE} failed",
        opened_at=timezone.now() - dt.timedelta(minutes=5),
        status=IncidentStatus.ACTIVE,
        severity=IncidentSeverity.SEV3,
        details={},
    )
    incident.nodes.add(node)
    _, token = ApiToken.issue(cast["admin"])
    return {"token": token, "incident": incident.pk}


def _known_ids(case, fleet: dict):
    """Half the cases name what exists, so the fuzz reaches past the 404s."""
    known = {"name": NODE, "incident_id": fleet["incident"], "drain_id": 1, "objective_id": 1}
    for key in case.path_parameters or {}:
        if key in known:
            case.path_parameters[key] = known[key]
    return case


def _no_such_route(case) -> bool:
    from django.urls import Resolver404, resolve

    try:
        resolve(case.formatted_path)
    except Resolver404:
        return True
    return False


def _fuzz_operation(operation, mode, base_url: str, fleet: dict, seen: dict) -> None:
    from schemathesis.checks import (
        content_type_conformance,
        not_a_server_error,
        response_schema_conformance,
        status_code_conformance,
    )

    node_route = operation.path.startswith("/api/nodes/") and operation.path.split("/")[-1] in (
        "register",
        "heartbeat",
        "deregister",
    )
    token = NODE_TOKEN if node_route else fleet["token"]
    strategy = operation.as_strategy(mode)

    @settings(
        max_examples=FUZZ_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=st.one_of(strategy, strategy.map(lambda c: _known_ids(c, fleet))))
    def run(case):
        response = case.call(base_url=base_url, headers={"Authorization": f"Bearer {token}"}, timeout=30)
        seen.setdefault(operation.label, []).append(response.status_code)
        if _no_such_route(case):
            # A path parameter the URLconf does not match (negative data: `-1` for an id): Django's own 404 page,
            # before any view; the document's routes are only those the URLconf has.
            assert response.status_code == 404, response.status_code
            return
        case.validate_response(
            response,
            checks=[
                not_a_server_error,
                status_code_conformance,
                content_type_conformance,
                response_schema_conformance,
            ],
        )
        if response.status_code >= 400:
            error = response.json()["error"]
            assert error["message"], response.text[:300]
            if response.status_code == 400:
                named = error.get("field", error.get("param"))
                assert isinstance(named, str), response.text[:300]  # the field, as sent (even a field named "")

    run()


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_the_console_api_fuzzed_answers_no_server_error_and_conforms_to_its_document(live_server, fleet, mode):
    import schemathesis
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_dict(openapi.document())
    seen: dict[str, list[int]] = {}
    generation = GenerationMode.POSITIVE if mode == "positive" else GenerationMode.NEGATIVE
    for result in schema.get_all_operations():
        _fuzz_operation(result.ok(), generation, live_server.url, fleet, seen)
    assert all(code < 500 for codes in seen.values() for code in codes), seen
    if mode == "positive":
        # The fuzz got past the token and reached the views, not only refusals.
        assert 200 in seen["GET /api/cluster"] and 200 in seen["GET /api/incidents/{incident_id}"]


@pytest.mark.parametrize(
    "method, path, body, field",
    [
        ("POST", "/api/drains", {"node": "fz-\u0000", "reason": "r"}, "node"),
        ("GET", "/api/incidents?node=fz%00a", None, "node"),
        ("GET", "/api/nodes/fz%00a/health", None, "name"),
        ("PATCH", "/api/settings", {"reason": "why\u0000"}, "reason"),
        ("POST", "/api/drains/1/approve", {"reason": "\u0000"}, "reason"),
        ("POST", "/api/nodes/register", {"name": "fz-b", "session": "0123456789ab\u0000"}, "session"),
        ("POST", "/api/nodes/fz%00a/heartbeat", {"session": "0123456789abcdef"}, "name"),
    ],
)
def test_a_nul_character_the_database_cannot_hold_is_a_400_naming_its_field(
    client, fleet_in_a_transaction, method, path, body, field
):
    """Found by the fuzz above: PostgreSQL's text refuses NUL, which was a server error (a 503 saying the database
    was down) wherever a NUL reached a query."""
    token = NODE_TOKEN if path.startswith("/api/nodes/") and "health" not in path else fleet_in_a_transaction["token"]
    response = client.generic(
        method,
        path,
        data=json.dumps(body) if body is not None else b"",
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {token}",
    )
    assert response.status_code == 400 and response.json()["error"]["field"] == field, response.content


@pytest.mark.parametrize(
    "query, param",
    [("limit=10000000000000000000000", "limit"), ("until=0895-01-19T16:15:19-18:57", "until")],
)
def test_incident_filters_the_database_cannot_take_are_a_400_naming_them(client, fleet_in_a_transaction, query, param):
    """Found by the fuzz: a limit past bigint, and a time offset PostgreSQL does not take, were server errors."""
    token = fleet_in_a_transaction["token"]
    response = client.get(f"/api/incidents?{query}", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert response.status_code in (200, 400), response.content
    if response.status_code == 400:
        assert response.json()["error"]["param"] == param
