"""The access matrix: every route of the console × every method it is asked with × every kind of caller → the status
it must answer (issue 17, docs/security.md).

The routes are read from the URL conf, so a route added without an entry here fails `test_every_route_has_an_entry`.
Callers: anonymous, a session of each role, and each kind of token (a user's API token, acting as an operator; the
node token; the agent and fault tokens the control plane presents to nodes; a gateway key). Only a user's API token
opens a JSON endpoint and only the node token opens the node endpoints: every other token is a stranger to the console.

What an entry states is who gets past the door, with the status they then get: the objects named in the URLs do not
exist (a 404 past the door) except the one node, so that nothing a request does changes what the next one sees.
"""

import uuid

import pytest
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver

from recovery import roles

pytestmark = pytest.mark.django_db

ANONYMOUS, USER_TOKEN, NODE_TOKEN, AGENT_TOKEN, FAULT_TOKEN, GATEWAY_KEY = (
    "anonymous",
    "user-api-token",
    "node-token",
    "agent-token",
    "fault-token",
    "gateway-key",
)
SESSIONS = roles.ROLES  # operator, oncall, manager, admin
TOKENS = (USER_TOKEN, NODE_TOKEN, AGENT_TOKEN, FAULT_TOKEN, GATEWAY_KEY)
CALLERS = (ANONYMOUS, *SESSIONS, *TOKENS)
TOKEN_ROLE = roles.OPERATOR  # the user API token acts as the operator
ALL = roles.ROLES
NODE = "node-m"  # the one object that exists
# Routes another change is adding; their entries wait here until the route lands.


def _others(status: int, **statuses: int) -> dict:
    return {caller: statuses.get(caller.replace("-", "_"), status) for caller in CALLERS}


def page(ok: int = 200, allowed: tuple = ALL, denied: int = 403) -> dict:
    """A console page: a login first (tokens do not open pages), then a role."""
    statuses = _others(302)
    for role in SESSIONS:
        statuses[role] = ok if role in allowed or role == roles.ADMIN else denied
    return statuses


def api(ok: int = 200, allowed: tuple = ALL) -> dict:
    """A JSON endpoint: a session or a user's API token, then a role; any other token is unknown (401)."""
    statuses = _others(401)
    for role in SESSIONS:
        statuses[role] = ok if role in allowed or role == roles.ADMIN else 403
    statuses[USER_TOKEN] = statuses[TOKEN_ROLE]
    return statuses


def node(ok: int = 400) -> dict:
    """The node protocol: the node token and nothing else (an empty body then is a 400)."""
    return _others(401, node_token=ok)


def everyone(status: int) -> dict:
    return _others(status)


ACT_ON_NODES = (roles.OPERATOR, roles.ONCALL)
RECEIVE_ALERTS = (roles.OPERATOR, roles.ONCALL)  # Alertmanager's webhook, with such a user's token
DECIDE_DRAINS = (roles.ONCALL,)  # and sending a dead letter again

# route name -> method -> caller -> status. GET and POST are asked of every route; other methods where listed.
MATRIX: dict[str, dict[str, dict]] = {
    "home": {"GET": everyone(302), "POST": everyone(302)},
    "cluster": {"GET": page(), "POST": page()},
    "incidents": {"GET": page(), "POST": page()},
    "incident": {"GET": page(404), "POST": page(404)},
    "incident-action": {"GET": everyone(405), "POST": page(404, ACT_ON_NODES)},
    "checkpoints": {"GET": page(), "POST": page()},
    "keys": {"GET": page(200, ()), "POST": page(400, ())},
    "key-revoke": {"GET": everyone(405), "POST": page(404, ())},
    # Restricting a tenant to trusted providers: an admin's; refused (no tenant) answers with the page's message.
    "keys-restrict": {"GET": everyone(405), "POST": page(302, ())},
    "drains": {"GET": page(), "POST": page()},
    "drain": {"GET": page(404), "POST": page(404)},
    "drain-action": {"GET": everyone(405), "POST": page(404)},
    "notification-resend": {"GET": everyone(405), "POST": page(404, DECIDE_DRAINS)},
    "profile": {"GET": page(), "POST": page(302, DECIDE_DRAINS)},
    "settings": {"GET": page(200, ()), "POST": page(400, ())},
    "degradation": {"GET": page(), "POST": page()},
    "placement": {"GET": page(), "POST": page()},
    # An operator or on-call asks for a re-placement; the answer (a proposal, or why none) shows on the page.
    "placement-propose": {"GET": everyone(405), "POST": page(302, (roles.OPERATOR, roles.ONCALL))},
    "placement-action": {"GET": everyone(405), "POST": page(404)},
    # MoE deployments: everyone reads; draining an expert worker is on-call's, as drains are.
    "moe": {"GET": page(), "POST": page()},
    "moe-deployment": {"GET": page(404), "POST": page(404)},
    "moe-drain": {"GET": everyone(405), "POST": page(404, (roles.ONCALL,))},
    "audit": {"GET": page(200, (roles.ONCALL, roles.MANAGER)), "POST": page(200, (roles.ONCALL, roles.MANAGER))},
    "runbook": {"GET": page(404), "POST": page(404)},
    "slo": {"GET": page(200, (roles.MANAGER, roles.ONCALL, roles.OPERATOR))},
    "slo-new": {"GET": page(200, (), denied=403), "POST": page(400, (), denied=403)},
    "slo-detail": {"GET": page(404, (roles.MANAGER, roles.ONCALL, roles.OPERATOR))},
    "slo-edit": {"GET": page(404), "POST": page(404)},
    "slo-corrections": {"GET": page(302), "POST": page(302, (), denied=403)},
    "slo-correction": {"GET": page(302), "POST": page(404, (), denied=403)},
    "reports": {"GET": page(200, (roles.MANAGER, roles.ONCALL, roles.OPERATOR))},
    "experiments": {
        "GET": page(200, (roles.OPERATOR, roles.MANAGER, roles.ONCALL)),
        "POST": page(400, (roles.OPERATOR, roles.MANAGER), denied=403),
    },
    # With no runs named, the comparison sends its reader back to the list.
    "experiment-compare": {"GET": page(302, (roles.OPERATOR, roles.MANAGER, roles.ONCALL))},
    "experiment": {"GET": page(404, (roles.OPERATOR, roles.MANAGER, roles.ONCALL))},
    "experiment-cancel": {"GET": everyone(405), "POST": page(404, (roles.OPERATOR, roles.MANAGER))},
    "experiment-summary-csv": {"GET": page(404, (roles.OPERATOR, roles.MANAGER, roles.ONCALL))},
    "experiment-windows-csv": {"GET": page(404, (roles.OPERATOR, roles.MANAGER, roles.ONCALL))},
    "node-drain": {"GET": everyone(405), "POST": page(400, (roles.OPERATOR, roles.ONCALL))},
    # An unknown spare: back to the node page with the reason.
    "node-spare": {"GET": everyone(405), "POST": page(302, (roles.ONCALL,))},
    "node-golden": {"GET": everyone(405), "POST": page(302, ())},
    "node": {"GET": page(), "POST": page()},
    "node-action": {"GET": everyone(405), "POST": page(404, ACT_ON_NODES)},
    "api-cluster": {"GET": api(), "POST": api(405)},
    "api-cluster-series": {"GET": api(), "POST": api(405)},
    "api-incidents": {"GET": api(), "POST": api(405)},
    "api-incident": {"GET": api(404), "POST": api(405)},
    "api-checkpoints": {"GET": api(), "POST": api(405)},
    # An empty body is not Alertmanager's notification: 400, naming what is missing.
    "api-alertmanager": {"GET": api(405, RECEIVE_ALERTS), "POST": api(400, RECEIVE_ALERTS)},
    # Past the door, fault injection is refused while it is off (LIFELINE_FAULTS_ENABLED): 403 with that reason.
    "api-node-fault": {"GET": api(405, (roles.OPERATOR,)), "POST": api(403, (roles.OPERATOR,))},
    # An empty body is a planned migration with the default reason.
    "api-node-migrate": {"GET": api(405, ACT_ON_NODES), "POST": api(202, ACT_ON_NODES)},
    "api-node-health": {"GET": api(), "POST": api(405)},
    "api-migration": {"GET": api(404), "POST": api(405)},
    "api-drains": {"GET": api(), "POST": api(400, (roles.OPERATOR, roles.ONCALL))},
    "api-drain": {"GET": api(404), "POST": api(405)},
    # The decision word is checked first: an unknown one is a 404 whatever the method.
    "api-drain-decide": {"GET": api(404), "POST": api(404)},
    "api-notifications": {"GET": api(), "POST": api(405)},
    "api-notification-resend": {"GET": api(405, DECIDE_DRAINS), "POST": api(404, DECIDE_DRAINS)},
    "api-degradation": {"GET": api(), "POST": api(405)},
    "api-placement-plan": {"GET": api(405), "POST": api()},
    "api-moe": {"GET": api(404), "POST": api(405)},
    "api-moe-fault": {"GET": api(405, (roles.OPERATOR,)), "POST": api(404, (roles.OPERATOR,))},
    # With one node of one model, the planner has nothing to switch: a proposal is refused (409), saying why.
    "api-placement-proposals": {"GET": api(), "POST": api(409, (roles.OPERATOR, roles.ONCALL))},
    "api-placement-proposal": {"GET": api(404), "POST": api(405)},
    "api-placement-proposal-decide": {"GET": api(404), "POST": api(404)},
    "api-settings": {"GET": api(200, ()), "POST": api(405, ()), "PATCH": api(200, ())},
    "api-slo": {"GET": api(200, (roles.MANAGER, roles.ONCALL, roles.OPERATOR))},
    "api-slo-one": {
        "GET": api(404, (roles.MANAGER, roles.ONCALL, roles.OPERATOR)),
        "PATCH": api(404, (roles.MANAGER, roles.ONCALL, roles.OPERATOR)),
    },
    "api-reports": {"GET": api(200, (roles.MANAGER, roles.ONCALL, roles.OPERATOR))},
    # The OpenAPI document of the JSON API: public, as the routes it describes are not.
    "api-schema": {"GET": everyone(200)},
    "healthz": {"GET": everyone(200), "POST": everyone(200)},
    "metrics": {"GET": api(), "POST": api()},
    "api-prometheus-targets": {"GET": api(), "POST": api(405)},
    # A session is sent on to the console; everyone else gets the form (an empty POST: the form with its errors).
    "login": {
        "GET": _others(200, operator=302, oncall=302, manager=302, admin=302),
        "POST": _others(200, operator=302, oncall=302, manager=302, admin=302),
    },
    "logout": {"GET": everyone(405), "POST": everyone(302)},
    # Single sign-on, off in this run (tests/browser/test_sso_browser.py signs in through a real provider).
    "oidc_authentication_init": {"GET": everyone(404), "POST": everyone(404)},
    "oidc_authentication_callback": {"GET": everyone(404), "POST": everyone(404)},
    "sso-refused": {"GET": everyone(403), "POST": everyone(405)},
    "node-register": {"GET": everyone(405), "POST": node()},
    "node-heartbeat": {"GET": everyone(405), "POST": node()},
    "node-deregister": {"GET": everyone(405), "POST": node()},
}
# Routes answered read-only whatever the method (a POST is a GET to them), stated once here rather than per route.
for name in ("slo", "slo-detail", "reports", "experiment-compare", "experiment", "experiment-summary-csv"):
    MATRIX[name].setdefault("POST", MATRIX[name]["GET"])
MATRIX["experiment-windows-csv"].setdefault("POST", MATRIX["experiment-windows-csv"]["GET"])
for name in ("api-slo", "api-reports"):
    MATRIX[name].setdefault("POST", api(405, (roles.MANAGER, roles.ONCALL, roles.OPERATOR)))
MATRIX["api-slo-one"].setdefault("POST", api(405, (roles.MANAGER, roles.ONCALL, roles.OPERATOR)))
MATRIX["api-schema"].setdefault("POST", everyone(405))

# Django's admin site: staff only, which among the roles is the admin; everyone else is sent to its login page.
ADMIN_CALLERS = (ANONYMOUS, roles.OPERATOR, roles.MANAGER, USER_TOKEN, NODE_TOKEN, GATEWAY_KEY)


def routes() -> dict[str, str]:
    """Every named route of the URL conf: name -> its pattern (admin routes as admin:<name>)."""
    found: dict[str, str] = {}

    def walk(patterns, prefix: str, namespace: str):
        for entry in patterns:
            if isinstance(entry, URLResolver):
                inner = entry.namespace or ""
                walk(entry.url_patterns, prefix + str(entry.pattern), ":".join(p for p in (namespace, inner) if p))
            elif isinstance(entry, URLPattern):
                if entry.name is None and namespace == "admin":  # the admin's redirect of an object's bare URL
                    name = f"admin:{prefix}{entry.pattern}"
                else:
                    assert entry.name, f"route {prefix}{entry.pattern} has no name: name it and give it an entry"
                    name = f"{namespace}:{entry.name}" if namespace else entry.name
                found[name] = prefix + str(entry.pattern)

    walk(get_resolver().url_patterns, "", "")
    return found


def concrete(pattern: str) -> str:
    """A URL for a pattern: a node name for names, an id no object has for ids, a nonsense word for actions."""
    import re

    def value(match):
        kind, name = match.group(1), match.group(2)
        if name == "name":
            return NODE
        if kind == "int" or name.endswith("_id") or name == "object_id":
            return "987654"
        return "no-such-thing"

    url = re.sub(r"<(?:(\w+):)?(\w+)>", value, pattern)
    url = re.sub(r"[\^$]", "", url)  # admin's regex routes
    url = re.sub(r"\(\?P<\w+>[^)]*\)", "x", url)
    return "/" + url


@pytest.fixture
def callers(cast, settings):
    """A test client per caller, with its credentials."""
    from console.models import ApiToken
    from recovery.actions import keys
    from tests.console.test_console import make_node

    settings.LIFELINE_NODE_TOKEN = "node-" + uuid.uuid4().hex
    settings.LIFELINE_AGENT_TOKEN = "agent-" + uuid.uuid4().hex
    settings.LIFELINE_FAULT_TOKEN = "fault-" + uuid.uuid4().hex
    make_node(NODE)
    _, user_token = ApiToken.issue(cast[TOKEN_ROLE], "matrix")
    _, gateway_key = keys.create_api_key("matrix", "standard")
    bearer = {
        USER_TOKEN: user_token,
        NODE_TOKEN: settings.LIFELINE_NODE_TOKEN,
        AGENT_TOKEN: settings.LIFELINE_AGENT_TOKEN,
        FAULT_TOKEN: settings.LIFELINE_FAULT_TOKEN,
        GATEWAY_KEY: gateway_key,
    }
    clients = {}
    for caller in CALLERS:
        if caller in bearer:
            clients[caller] = Client(headers={"authorization": f"Bearer {bearer[caller]}"})
        else:
            clients[caller] = Client()
            if caller in SESSIONS:
                clients[caller].force_login(cast[caller])
                clients[caller].session_user = cast[caller]
    return clients


def client_user(callers, caller):
    return callers[caller].session_user


def test_every_route_has_an_entry():
    names = set(routes())
    missing = sorted(name for name in names if name not in MATRIX and not name.startswith("admin:"))
    assert not missing, f"routes with no entry in the access matrix: {missing}: add one to MATRIX"
    stale = set(MATRIX) - names
    assert not stale, f"entries for routes that no longer exist: {sorted(stale)}"
    for name, methods in MATRIX.items():
        assert {"GET", "POST"} <= set(methods), f"{name}: GET and POST must both be stated"
        for method, statuses in methods.items():
            assert set(statuses) == set(CALLERS), f"{name} {method}: every caller must be stated"


def test_every_route_answers_every_caller_as_the_matrix_says(callers):
    wrong = []
    for name, pattern in sorted(routes().items()):
        if name.startswith("admin:"):
            continue
        url = concrete(pattern)
        for method, statuses in MATRIX[name].items():
            for caller, expected in statuses.items():
                client = callers[caller]
                if name == "logout" and caller in SESSIONS:  # a session of its own, not the one the others use
                    client = Client()
                    client.force_login(client_user(callers, caller))
                response = client.generic(method, url, b"", content_type="application/x-www-form-urlencoded")
                if response.status_code != expected:
                    wrong.append(f"{method} {url} as {caller}: {response.status_code}, expected {expected}")
                elif expected == 302 and caller not in SESSIONS and name not in ("home", "logout"):
                    # A page sends a stranger to the login page, never on to somewhere else.
                    if not response["Location"].startswith("/login/"):
                        wrong.append(f"{method} {url} as {caller}: redirected to {response['Location']}")
    assert not wrong, "\n".join(wrong)


def test_the_admin_site_is_for_the_admin_role_only(callers):
    admin_routes = {name: pattern for name, pattern in routes().items() if name.startswith("admin:")}
    assert "admin:index" in admin_routes
    wrong = []
    for name, pattern in sorted(admin_routes.items()):
        if name in ("admin:login", "admin:logout", "admin:jsi18n"):
            continue
        url = concrete(pattern)
        for caller in ADMIN_CALLERS:
            response = callers[caller].get(url)
            if response.status_code != 302 or not response["Location"].startswith("/admin/login/"):
                wrong.append(f"GET {url} as {caller}: {response.status_code} {response.get('Location', '')}")
    assert callers[roles.ADMIN].get("/admin/").status_code == 200
    assert not wrong, "\n".join(wrong)
