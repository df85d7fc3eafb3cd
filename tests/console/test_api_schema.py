"""`/api/schema`: the OpenAPI 3 documents are valid, served anonymously, and true to console/urls.py: every `api/...`
route and every method it answers is in the console's document, and the document names nothing the URLs lack."""

import re

import pytest
from django.urls import URLPattern, URLResolver, get_resolver

from console import openapi
from console.models import ApiToken

METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
# A value for each kind of path parameter, so a route can be called; a decision must be one to reach its method check.
SAMPLE = {"int": "1", "str": "x", "slug": "x", "decision": "approve"}


def _routes(resolver: URLResolver = None, prefix: str = "") -> list[str]:
    """Every route of the URLconf as Django writes it (`api/incidents/<int:incident_id>`), includes walked."""
    routes = []
    for pattern in (resolver or get_resolver()).url_patterns:
        route = prefix + str(pattern.pattern)
        if isinstance(pattern, URLResolver):
            routes += _routes(pattern, route)
        elif isinstance(pattern, URLPattern):
            routes.append(route)
    return routes


def _openapi_path(route: str) -> str:
    return "/" + re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", route)


def _concrete(route: str) -> str:
    def value(match):
        converter, name = match.group(1) or "str", match.group(2)
        return SAMPLE.get(name) or SAMPLE[converter]

    return "/" + re.sub(r"<(?:(\w+):)?(\w+)>", value, route)


def _api_routes() -> dict[str, str]:
    return {_openapi_path(r): r for r in _routes() if r.startswith("api/")}


def test_every_document_is_openapi_3_that_schemathesis_reads_whole():
    import schemathesis

    for surface in openapi.SURFACES:
        schema = schemathesis.openapi.from_dict(openapi.surface(surface))
        operations = [result.ok() for result in schema.get_all_operations()]  # raises on a broken operation
        assert len(operations) == sum(
            len([m for m in item if m != "parameters"]) for item in openapi.surface(surface)["paths"].values()
        )


def test_every_api_route_is_in_the_document_and_the_document_names_no_other():
    documented = set(openapi.document()["paths"])
    routes = set(_api_routes())
    assert routes - documented == set(), "routes missing from console/openapi.py"
    assert documented - routes == set(), "documented paths console/urls.py does not have"


@pytest.mark.django_db
def test_every_method_a_route_answers_is_documented_and_every_documented_one_is_answered(client, cast, settings):
    settings.LIFELINE_NODE_TOKEN = "node-token-for-the-method-walk"
    _, token = ApiToken.issue(cast["admin"])
    paths = openapi.document()["paths"]
    wrong = []
    for path, route in sorted(_api_routes().items()):
        documented = {m.upper() for m in paths[path] if m != "parameters"}
        for method in METHODS:
            response = client.generic(
                method,
                _concrete(route),
                data=b"{}",
                content_type="application/json",
                HTTP_AUTHORIZATION=f"Bearer {token}",
            )
            answered = response.status_code != 405
            if answered != (method in documented):
                wrong.append((method, path, response.status_code))
    assert wrong == [], wrong


@pytest.mark.django_db
def test_the_schema_is_served_anonymously_as_json(client):
    response = client.get("/api/schema")
    assert response.status_code == 200 and response["Content-Type"] == "application/json"
    document = response.json()
    assert document["openapi"].startswith("3.") and "/api/cluster" in document["paths"]
    assert document["components"]["securitySchemes"]["apiToken"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "a user's API token",
    }
    assert "/v1/chat/completions" in client.get("/api/schema?surface=gateway").json()["paths"]
    assert "/agent/kv/batch" in client.get("/api/schema?surface=node").json()["paths"]
    refused = client.get("/api/schema?surface=ui")
    assert refused.status_code == 400 and refused.json()["error"]["field"] == "surface"
    assert client.post("/api/schema").status_code == 405


def test_the_node_document_names_every_control_route():
    from workers import control_api

    documented = {
        (method.upper(), path)
        for path, item in openapi.node_document()["paths"].items()
        for method in item
        if method != "parameters"
    }
    assert documented == {(method, path) for method, path, _, _ in control_api.ROUTES}
