"""Issue 17's security review, enforced (docs/security.md): production settings, CSRF, log-in rate limiting and its
audit, secrets at rest, node tokens, and request body limits."""

import ast
import asyncio
import json
import os
import re
import secrets
import subprocess
import sys
import uuid

import pytest
from django.test import Client

from console.models import ApiToken, digest
from recovery.models import ApiKey, AuditEntry
from tests.helpers import BASE_DIR
from tests.test_access_matrix import MATRIX, concrete, routes
from workers.runtime import node_token, node_token_name

PRODUCTION_ENV = {
    "LIFELINE_PRODUCTION": "1",
    "LIFELINE_SECRET_KEY": "k" * 10 + secrets.token_urlsafe(60),
    "LIFELINE_ALLOWED_HOSTS": "lifeline.example.com",
    "LIFELINE_DEBUG": "0",
}


def _manage(*argv: str, env: dict) -> subprocess.CompletedProcess:
    clean = {
        k: v for k, v in os.environ.items() if not k.startswith(("LIFELINE_SECURE", "LIFELINE_HSTS", "LIFELINE_SSL"))
    }
    return subprocess.run(
        [sys.executable, *argv], cwd=BASE_DIR, env={**clean, **env}, capture_output=True, text=True, timeout=120
    )


# --- Production settings ------------------------------------------------------------------------------------------


def test_check_deploy_is_clean_under_production_settings():
    result = _manage("manage.py", "check", "--deploy", "--fail-level", "WARNING", env=PRODUCTION_ENV)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def test_check_deploy_warns_without_the_production_switch():
    """The switch is what makes the check clean: without it the same command fails."""
    env = {**PRODUCTION_ENV, "LIFELINE_PRODUCTION": "0"}
    result = _manage("manage.py", "check", "--deploy", "--fail-level", "WARNING", env=env)
    assert result.returncode != 0
    assert "security.W012" in result.stderr + result.stdout  # SESSION_COOKIE_SECURE


def test_production_refuses_debug():
    result = _manage("manage.py", "check", env={**PRODUCTION_ENV, "LIFELINE_DEBUG": "1"})
    assert result.returncode != 0 and "never runs with DEBUG" in result.stderr


def test_passwords_are_stored_with_django_s_default_pbkdf2():
    """The tests log in with a fast hasher (tests/conftest.py); the settings every process runs keep Django's."""
    from django.conf import global_settings

    from console import settings as production

    hashers = getattr(production, "PASSWORD_HASHERS", global_settings.PASSWORD_HASHERS)
    assert hashers[0] == "django.contrib.auth.hashers.PBKDF2PasswordHasher"


HEADERS_SCRIPT = """
import json, django
django.setup()
from django.test import Client
client = Client(HTTP_HOST="lifeline.example.com")
plain = client.get("/login/")
page = client.get("/login/", secure=True)
print(json.dumps({
    "plain": [plain.status_code, plain.get("Location", "")],
    "headers": {k: page.get(k) for k in ("Strict-Transport-Security", "X-Frame-Options", "X-Content-Type-Options",
                                          "Referrer-Policy", "Cross-Origin-Opener-Policy")},
    "csrf_cookie": page.cookies["csrftoken"].output(),
    "healthz": client.get("/healthz").status_code,
}))
"""


def test_production_headers_cookies_and_https_redirect():
    env = {**PRODUCTION_ENV, "DJANGO_SETTINGS_MODULE": "console.settings"}
    result = _manage("-c", HEADERS_SCRIPT, env=env)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["plain"] == [301, "https://lifeline.example.com/login/"]
    headers = seen["headers"]
    assert headers["Strict-Transport-Security"] == "max-age=31536000; includeSubDomains; preload"
    assert headers["X-Frame-Options"] == "DENY"
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert headers["Referrer-Policy"] == "same-origin"
    assert headers["Cross-Origin-Opener-Policy"] == "same-origin"
    assert "Secure" in seen["csrf_cookie"] and "SameSite=Lax" in seen["csrf_cookie"]
    assert seen["healthz"] != 301  # load balancers may check health over plain HTTP


@pytest.mark.django_db
def test_session_cookie_is_secure_httponly_samesite(settings, cast):
    settings.SESSION_COOKIE_SECURE = True  # what LIFELINE_PRODUCTION sets (the test above reads it from settings)
    client = Client()
    response = client.post(
        "/login/", {"username": "manager", "password": "correct-horse-manager"}, secure=True, follow=False
    )
    assert response.status_code == 302
    cookie = response.cookies["sessionid"]
    assert cookie["secure"] and cookie["httponly"] and cookie["samesite"] == "Lax"


# --- CSRF on every form -------------------------------------------------------------------------------------------

CSRF_EXEMPT = {
    "node-register": "the node protocol: a bearer token, no cookie",
    "node-heartbeat": "the node protocol: a bearer token, no cookie",
    "node-deregister": "the node protocol: a bearer token, no cookie",
}


@pytest.mark.django_db
def test_every_post_with_a_session_needs_the_csrf_token(cast):
    client = Client(enforce_csrf_checks=True)
    client.force_login(cast["admin"])
    missing = []
    for name, pattern in sorted(routes().items()):
        if name.startswith("admin:") or name in CSRF_EXEMPT or name == "logout":
            continue
        for method in ("POST", "PATCH"):
            if method not in MATRIX[name] or MATRIX[name][method]["admin"] == 405:
                continue
            response = client.generic(
                method, concrete(pattern), b"x=1", content_type="application/x-www-form-urlencoded"
            )
            if response.status_code != 403:
                missing.append(f"{method} {name}: {response.status_code}")
    assert not missing, f"state-changing requests accepted without the CSRF token: {missing}"
    # Logging out is a POST too (checked last: it ends the session).
    assert client.post("/logout/").status_code == 403
    anonymous = Client(enforce_csrf_checks=True)
    assert anonymous.post("/login/", {"username": "admin", "password": "correct-horse-admin"}).status_code == 403


def test_every_form_template_carries_the_csrf_token():
    for path in (BASE_DIR / "templates").rglob("*.html"):
        html = path.read_text()
        for form in re.findall(r"<form\b[^>]*>.*?</form>", html, flags=re.S | re.I):
            if re.search(r'method=["\']?post', form, flags=re.I):
                assert "{% csrf_token %}" in form, f"{path.relative_to(BASE_DIR)}: a POST form without csrf_token"


# --- Log-in rate limiting and its audit ---------------------------------------------------------------------------


@pytest.fixture
def someone(django_user_model):
    name = f"user-{uuid.uuid4().hex[:8]}"
    from console.actions import set_user_role

    return set_user_role(name, "operator", password="right-password-123")


@pytest.mark.django_db
def test_login_is_refused_after_repeated_failures_and_every_failure_is_audited(settings, someone):
    settings.LIFELINE_LOGIN_MAX_FAILURES = 3
    name = someone.username
    client = Client(REMOTE_ADDR="10.9.8.7")
    for _ in range(3):
        response = client.post("/login/", {"username": name, "password": "wrong"})
        assert response.status_code == 200 and b"do not match" in response.content
    assert AuditEntry.objects.filter(action="login_failed", target=f"user:{name}").count() == 3
    assert AuditEntry.objects.filter(action="login_failed").first().details["address"] == "10.9.8.7"
    # Now even the right password is refused, with a message that says why and for how long.
    response = client.post("/login/", {"username": name, "password": "right-password-123"})
    assert response.status_code == 429
    assert b"Too many failed log-ins" in response.content and b"try again in 15 minutes" in response.content
    assert int(response["Retry-After"]) > 800
    assert "_auth_user_id" not in client.session
    assert AuditEntry.objects.filter(action="login_throttled", target=f"user:{name}").count() == 1
    # The admin site's log-in is the same door.
    assert client.post("/admin/login/", {"username": name, "password": "right-password-123"}).status_code == 429
    # Another address is not locked out by this one's guesses.
    other = Client(REMOTE_ADDR="10.9.8.8")
    assert other.post("/login/", {"username": name, "password": "right-password-123"}).status_code == 302


@pytest.mark.django_db
def test_a_successful_login_forgets_earlier_failures(settings, someone):
    settings.LIFELINE_LOGIN_MAX_FAILURES = 3
    client = Client(REMOTE_ADDR="10.9.8.9")
    for _ in range(2):
        client.post("/login/", {"username": someone.username, "password": "wrong"})
    assert client.post("/login/", {"username": someone.username, "password": "right-password-123"}).status_code == 302
    client.logout()
    for _ in range(2):
        client.post("/login/", {"username": someone.username, "password": "wrong"})
    assert client.post("/login/", {"username": someone.username, "password": "right-password-123"}).status_code == 302


# --- Secrets at rest ----------------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_api_tokens_are_stored_hashed_revocable_and_record_last_use(cast):
    row, token = ApiToken.issue(cast["operator"], "dump test")
    stored = json.dumps(list(ApiToken.objects.filter(pk=row.pk).values()), default=str)
    assert token not in stored and token[12:] not in stored and row.digest == digest(token)
    client = Client(headers={"authorization": f"Bearer {token}"})
    assert client.get("/api/cluster").status_code == 200
    row.refresh_from_db()
    assert row.last_used_at is not None
    from django.core.management import call_command

    call_command("revoke_token", row.prefix, stdout=open(os.devnull, "w"))
    assert client.get("/api/cluster").status_code == 401
    assert AuditEntry.objects.filter(action="revoke_token", target=f"api_token:{row.prefix}").exists()


@pytest.mark.django_db
def test_gateway_keys_are_stored_hashed_and_shown_once(cast):
    client = Client()
    client.force_login(cast["admin"])
    response = client.post("/keys/", {"tenant": "acme", "tier": "standard", "label": "dump test"})
    assert response.status_code == 200
    key = response.context["created"]
    assert key and key in response.content.decode()
    stored = json.dumps(list(ApiKey.objects.values()), default=str)
    assert key not in stored and key[12:] not in stored
    assert key not in client.get("/keys/").content.decode()  # shown once, at creation


# Credentials by their names here. A bare "token" is an LLM token (an id) in this code base, and a KV page's digest is
# an integrity check, not a secret: neither is named below.
SECRET_NAMES = re.compile(r"secret|password|passwd|api_key|bearer|credential|(agent|fault|node|api|user|gateway)_token")


def test_no_secret_is_compared_with_equals():
    """Tokens and secrets are compared with hmac.compare_digest (workers.runtime.token_matches), never ==."""
    found = []
    for package in ("console", "recovery", "workers"):
        for path in (BASE_DIR / package).rglob("*.py"):
            if "migrations" in path.parts or "sim" in path.parts:  # the simulator's "token" is a run counter
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops):
                    for side in (node.left, *node.comparators):
                        name = side.id if isinstance(side, ast.Name) else getattr(side, "attr", None)
                        if name and SECRET_NAMES.search(name.lower()):
                            found.append(f"{path.relative_to(BASE_DIR)}:{node.lineno} {ast.unparse(node)}")
    assert not found, f"secrets compared with ==: {found}"


# --- Node tokens ----------------------------------------------------------------------------------------------------


def registration(name: str) -> dict:
    return {
        "name": name,
        "session": uuid.uuid4().hex,
        "address": "http://10.1.0.9:8201",
        "rack": "rack-a",
        "model": "Qwen3-32B",
        "gpu": "H200-SXM",
        "tp": 1,
        "pid": 4242,
        "host": "h",
        "gpus": [{"index": 0, "uuid": f"GPU-{name}", "name": "NVIDIA H200", "memory_bytes": 141 * 10**9}],
    }


def test_a_node_token_names_its_node():
    token = node_token("s" * 40, "node-07")
    assert node_token_name(token, ("s" * 40,)) == "node-07"
    assert node_token_name(token, ("t" * 40, "s" * 40)) == "node-07"  # the previous secret, during a rotation
    assert node_token_name(token, ("t" * 40,)) is None
    assert node_token_name(token.replace("node-07", "node-08"), ("s" * 40,)) is None
    assert node_token_name("lln.node-07", ("s" * 40,)) is None
    assert node_token_name(None, ("s" * 40,)) is None


@pytest.mark.django_db
def test_a_per_node_token_speaks_only_for_its_node(settings):
    settings.LIFELINE_NODE_TOKEN = None  # per-node tokens only
    settings.LIFELINE_NODE_TOKEN_SECRET = "secret-" + uuid.uuid4().hex
    mine = Client(headers={"authorization": f"Bearer {node_token(settings.LIFELINE_NODE_TOKEN_SECRET, 'node-p1')}"})
    theirs = Client(headers={"authorization": f"Bearer {node_token(settings.LIFELINE_NODE_TOKEN_SECRET, 'node-p2')}"})
    reg = registration("node-p1")
    assert mine.post("/api/nodes/register", reg, content_type="application/json").status_code == 200
    # Another node's token can neither register under this name nor beat or leave for it, session known or not.
    refused = theirs.post("/api/nodes/register", registration("node-p1"), content_type="application/json")
    assert refused.status_code == 403 and "node-p2" in refused.json()["error"]["message"]
    beat = {"session": reg["session"]}
    assert theirs.post("/api/nodes/node-p1/heartbeat", beat, content_type="application/json").status_code == 403
    assert theirs.post("/api/nodes/node-p1/deregister", beat, content_type="application/json").status_code == 403
    # Its own token passes the door (what the heartbeat then does is tests/recovery's business).
    assert mine.post("/api/nodes/node-p1/heartbeat", beat, content_type="application/json").status_code not in (
        401,
        403,
    )
    # The shared token is refused when none is set; a token made with another secret too.
    stranger = Client(headers={"authorization": f"Bearer {node_token('other-secret', 'node-p1')}"})
    assert stranger.post("/api/nodes/node-p1/heartbeat", beat, content_type="application/json").status_code == 401


@pytest.mark.django_db
def test_node_tokens_rotate(settings):
    old, new = "old-" + uuid.uuid4().hex, "new-" + uuid.uuid4().hex
    settings.LIFELINE_NODE_TOKEN, settings.LIFELINE_NODE_TOKEN_PREVIOUS = new, old
    settings.LIFELINE_NODE_TOKEN_SECRET = settings.LIFELINE_NODE_TOKEN_SECRET_PREVIOUS = None
    for token in (old, new):
        client = Client(headers={"authorization": f"Bearer {token}"})
        assert (
            client.post("/api/nodes/register", registration("node-r1"), content_type="application/json").status_code
            == 200
        )
    settings.LIFELINE_NODE_TOKEN_PREVIOUS = None  # the rollover is over
    client = Client(headers={"authorization": f"Bearer {old}"})
    assert (
        client.post("/api/nodes/register", registration("node-r1"), content_type="application/json").status_code == 401
    )


def test_fault_injection_is_not_routed_by_the_gateway():
    """The gateway's port serves the OpenAI API, its health and metrics, and nothing that reaches a node's faults."""
    source = (BASE_DIR / "recovery" / "gateway" / "app.py").read_text()
    paths = re.findall(r"add_(?:get|post|put|patch|delete|route)\((?:\"\w+\", )?\"([^\"]+)\"", source)
    assert "/v1/completions" in paths
    assert not [p for p in paths if "fault" in p or "{" in p], paths


# --- Request bodies -------------------------------------------------------------------------------------------------

ONE_GB = 1 << 30


async def _asgi(path: str, *, content_length: int | None, chunk: bytes, chunks_at_most: int):
    """Send `path` a POST whose body is `chunk` repeated (never built whole); what came back, and how many chunks the
    application asked for."""
    from console.asgi import application

    headers = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"), (b"authorization", b"Bearer x")]
    if content_length is not None:
        headers.append((b"content-length", str(content_length).encode()))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": headers,
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8000),
    }
    asked = 0
    sent: list[dict] = []

    async def receive():
        nonlocal asked
        asked += 1
        if asked > chunks_at_most:
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message):
        sent.append(message)

    await asyncio.wait_for(application(scope, receive, send), timeout=30)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], body, asked


@pytest.mark.parametrize("path", ["/api/drains", "/api/nodes/node-x/heartbeat", "/login/", "/api/nodes/register"])
def test_a_1gb_body_is_refused_before_it_is_read(path, settings):
    status, body, asked = asyncio.run(_asgi(path, content_length=ONE_GB, chunk=b"x" * 65536, chunks_at_most=ONE_GB))
    assert status == 413 and asked == 0
    assert "LIFELINE_MAX_BODY_BYTES" in json.loads(body)["error"]["message"]


@pytest.mark.parametrize("path", ["/api/drains", "/api/nodes/node-x/heartbeat"])
def test_a_streamed_body_without_a_length_is_cut_off_at_the_limit(path, settings):
    chunk = b"x" * (1 << 20)
    limit_chunks = settings.LIFELINE_MAX_BODY_BYTES // len(chunk)
    # 1 GiB offered, a MiB at a time: the application stops asking just past the limit.
    status, body, asked = asyncio.run(_asgi(path, content_length=None, chunk=chunk, chunks_at_most=1024))
    assert status == 413 and asked <= limit_chunks + 1
    assert json.loads(body)["error"]["status"] == 413


def test_the_node_agent_refuses_a_huge_body_with_a_json_413(node_factory):
    """aiohttp's client_max_size (64 MiB on a node, for checkpoint pages; 16 MiB on the gateway): a body past it is
    refused, in memory no larger than the limit, with the JSON error of every refusal."""
    import http.client
    from urllib.parse import urlsplit

    node = node_factory("node-big")
    address = urlsplit(node.address)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=30)
    chunk = b"x" * (1 << 20)
    try:  # 128 MiB, a MiB at a time: never built whole
        connection.request(
            "POST",
            "/v1/completions",
            body=(chunk for _ in range(128)),
            headers={"Content-Type": "application/json"},
            encode_chunked=True,
        )
    except (BrokenPipeError, ConnectionResetError):
        pass  # it stopped reading: the answer is waiting
    response = connection.getresponse()
    assert response.status == 413
    assert "Too Large" in json.loads(response.read())["error"]["message"]
    connection.close()
