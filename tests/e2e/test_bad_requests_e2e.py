"""Bad requests against the whole system: `manage.py demo` with its Celery worker and beat, a real gateway and nodes.

The poison requests that once opened every breaker in 100 ms are sent more
than a hundred times each, and a query of death that makes every engine fail
is sent as often: the control plane, reading what the gateway reports, keeps
every breaker closed and every weight at 1. A node that really is broken
still has its breaker opened, by distinct requests that other nodes served.
"""

import json
import urllib.error
import urllib.request

import pytest

from tests.helpers import wait_for
from tests.recovery.gateway.test_bad_requests import EXPECTED_PARAM, POISON, raw_json

pytestmark = pytest.mark.e2e


def _call(stack, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(
        stack.info["urls"]["gateway"].rstrip("/") + "/chat/completions",
        data=body,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {stack.info['gateway_key']}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _fleet(stack) -> dict[str, dict]:
    status, body = stack.api("/api/cluster")
    assert status == 200, body
    return {n["name"]: n for n in body["nodes"]}


def _inject(stack, node: str, fault: dict) -> None:
    base = stack.info["urls"]["console"].rstrip("/")
    request = urllib.request.Request(
        f"{base}/api/nodes/{node}/faults",
        data=json.dumps({**fault, "reason": "issue 19 drill"}).encode(),
        headers={"Authorization": f"Bearer {stack.info['api_token']}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


def _clear(stack, node: str) -> None:
    address = _fleet(stack)[node]["address"]  # where it serves now: a node restarted since the stack began moved
    request = urllib.request.Request(
        f"{address}/agent/faults", method="DELETE", headers={"Authorization": f"Bearer {stack.info['fault_token']}"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


def _control_plane_caught_up(stack) -> None:
    """The Celery worker has read and handled every signal the gateway has written so far."""
    import redis

    from recovery.actions.streams import GROUP
    from recovery.keys import Keys

    client = redis.Redis.from_url(stack.info["redis_url"], decode_responses=True)
    stream = Keys(stack.env["LIFELINE_NAMESPACE"]).signals
    last = client.xrevrange(stream, count=1)[0][0]

    def caught_up():
        group = next((g for g in client.xinfo_groups(stream) if g["name"] == GROUP), None)  # None: no worker read yet
        return group is not None and group["last-delivered-id"] == last and group["pending"] == 0

    wait_for(caught_up, 30, 0.2, "the control plane to handle every gateway signal")


def _all_serving(stack) -> dict[str, dict]:
    fleet = wait_for(
        lambda: (f := _fleet(stack)) and all(n["state"] == "serving" for n in f.values()) and f,
        60,
        0.5,
        "every node serving",
    )
    assert all(n["breaker"] == "closed" and n["weight"] == 1.0 for n in fleet.values()), fleet
    return fleet


def test_poison_requests_a_hundred_times_each_leave_every_breaker_closed(demo_stack):
    _all_serving(demo_stack)
    for name, body in POISON.items():
        for _ in range(110):
            status, answer = _call(demo_stack, raw_json(body))
            assert status == 400 and answer["error"]["param"] == EXPECTED_PARAM[name], (name, status, answer)
    status, answer = _call(
        demo_stack,
        raw_json({"model": "Qwen3-32B", "messages": [{"role": "user", "content": "still up?"}], "max_tokens": 4}),
    )
    assert status == 200, answer
    fleet = _fleet(demo_stack)
    assert {(n["breaker"], n["weight"], n["health"]) for n in fleet.values()} == {("closed", 1.0, "healthy")}, fleet


def test_a_query_of_death_on_every_engine_opens_no_breaker(demo_stack):
    names = sorted(_all_serving(demo_stack))
    for name in names:
        _inject(demo_stack, name, {"kind": "poison", "match": "xyzzy plugh"})
    try:
        for i in range(110):
            status, answer = _call(
                demo_stack,
                raw_json(
                    {
                        "model": "Qwen3-32B",
                        "messages": [{"role": "user", "content": f"xyzzy plugh {i % 4}"}],
                        "max_tokens": 4,
                    }
                ),
            )
            assert status == 500 and answer["error"]["code"] == "request_failed_on_two_nodes", answer
        status, answer = _call(
            demo_stack,
            raw_json(
                {"model": "Qwen3-32B", "messages": [{"role": "user", "content": "an honest question"}], "max_tokens": 4}
            ),
        )
        assert status == 200, answer
        _control_plane_caught_up(demo_stack)
        fleet = _fleet(demo_stack)
        assert {(n["breaker"], n["weight"]) for n in fleet.values()} == {("closed", 1.0)}, fleet
    finally:
        for name in names:
            _clear(demo_stack, name)


def test_a_node_that_fails_every_request_still_has_its_breaker_opened(demo_stack):
    names = sorted(_all_serving(demo_stack))
    broken = names[0]
    _inject(demo_stack, broken, {"kind": "poison", "match": ""})
    try:

        def opened():
            for _ in range(6):
                status, answer = _call(
                    demo_stack,
                    raw_json(
                        {
                            "model": "Qwen3-32B",
                            "messages": [{"role": "user", "content": f"question {opened.n}"}],
                            "max_tokens": 3,
                        }
                    ),
                )
                opened.n += 1
                assert status == 200, answer  # served by another node every time
            return _fleet(demo_stack)[broken]["breaker"] == "open"

        opened.n = 0
        wait_for(opened, 60, 0.5, f"{broken}'s breaker opening")
        fleet = _fleet(demo_stack)
        assert fleet[broken]["weight"] == 0.0
        assert all(fleet[name]["breaker"] == "closed" for name in names[1:]), fleet
    finally:
        _clear(demo_stack, broken)
