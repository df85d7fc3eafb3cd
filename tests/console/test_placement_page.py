"""The Placement page and its API (issue 14, parts 3 and 5 on demand): the live fleet as a matrix of models × GPU
types, the planner's placement beside the current one, each judged by the simulator, the moves and their cost,
and what-if questions (a rack lost, servers added) answered without changing anything."""

import re
import uuid

import pytest

from console.models import ApiToken
from recovery.actions import nodes, placement
from recovery.models import Cluster, ModelCapacity, Node
from workers.protocol import Registration

pytestmark = pytest.mark.django_db


def register(name: str, rack: str, model: str, gpu: str = "H100-SXM", tp: int = 4, server: str = "") -> None:
    data = {
        "name": name,
        "session": uuid.uuid4().hex,
        "address": f"http://127.0.0.1:{9000 + len(name)}",
        "rack": rack,
        "model": model,
        "gpu": gpu,
        "tp": tp,
        "pid": 1,
        "host": "h",
        "gpus": [{"index": i, "uuid": f"GPU-{name}-{i}", "name": gpu, "memory_bytes": 80 * 10**9} for i in range(tp)],
    }
    if server:
        data["server"] = server
    nodes.register_node(Registration.parse(data))


@pytest.fixture
def fleet(db):
    """Llama-3-70B all in rack-a (as fleets grow), Llama-3-8B in racks b and c; objectives for both."""
    for i in range(1, 3):
        register(f"a{i}", "rack-a", "Llama-3-70B", tp=8)
    for rack in ("b", "c"):
        for i in range(1, 3):
            register(f"{rack}{i}", f"rack-{rack}", "Llama-3-8B")
    cluster = Cluster.default()
    ModelCapacity.objects.create(
        cluster=cluster, model_key="Llama-3-70B", required_rps=6, avg_prompt_tokens=1000, avg_output_tokens=200
    )
    ModelCapacity.objects.create(
        cluster=cluster, model_key="Llama-3-8B", required_rps=40, avg_prompt_tokens=1000, avg_output_tokens=200
    )


@pytest.fixture
def token(cast):
    _, value = ApiToken.issue(cast["oncall"])
    return {"HTTP_AUTHORIZATION": f"Bearer {value}"}


def test_the_live_fleet_is_read_as_servers_with_their_replicas(fleet):
    register("s1-x", "rack-b", "Llama-3-8B", tp=2, server="box-1")
    register("s1-y", "rack-b", "Qwen3-32B", tp=4, server="box-1")
    servers, current = placement.live_fleet()
    box = next(s for s in servers if s.name == "box-1")
    assert box.gpus == 6 and box.rack == "rack-b" and box.gpu == "H100-SXM"
    assert sorted((r.model, r.tp) for r in current["box-1"]) == [("Llama-3-8B", 2), ("Qwen3-32B", 4)]
    assert {(r.model, r.tp) for r in current["a1"]} == {("Llama-3-70B", 8)}
    demands = {d.model: d for d in placement.live_demands({"Llama-3-8B", "Llama-3-70B", "Qwen3-32B"})}
    assert demands["Llama-3-70B"].rate_rps == 6 and demands["Llama-3-70B"].prompt_tokens == 1000
    assert demands["Qwen3-32B"].rate_rps == 0  # served, with no objective and no traffic yet


def test_the_page_shows_the_matrix_and_a_plan_for_a_lost_rack(client, cast, fleet):
    client.force_login(cast["oncall"])
    html = client.get("/placement/").content.decode()
    assert 'id="placement-table"' in html and 'id="placement-plan"' not in html  # no plan until asked
    row = re.search(r'<tr data-model="Llama-3-70B">.*?</tr>', html, re.S).group(0)
    assert "16× H100-SXM TP8" in row
    # What if rack-a is lost: the plan moves Llama-3-70B onto racks b and c, and the simulator judges both.
    response = client.post("/placement/", {"lose_racks": ["rack-a"]})
    assert response.status_code == 200
    html = response.content.decode()
    row = re.search(r'<tr data-model="Llama-3-70B">.*?</tr>', html, re.S).group(0)
    proposed = re.search(r'data-side="proposed">(.*?)</td>', row, re.S).group(1)
    assert "H100-SXM TP4" in proposed or "H100-SXM TP8" in proposed
    assert 'id="plan-moves"' in html and "Llama-3-70B TP" in html
    assert re.search(r'data-figures="proposed"><span class="badge badge-green">', row)
    Node.objects.get(name="a1")  # nothing changed: asking for a plan is only asking


def test_the_api_plans_what_ifs_and_says_what_is_wrong(client, fleet, token):
    response = client.post(
        "/api/placement/plan", {"lose_racks": ["rack-a"], "evaluate": True}, content_type="application/json", **token
    )
    assert response.status_code == 200
    result = response.json()
    assert result["solver"]["status"] in ("OPTIMAL", "FEASIBLE") and result["problems"] == []
    assert result["proposed"]["racks"] == ["rack-b", "rack-c"]
    assert result["proposed"]["capacity_rps"]["Llama-3-70B"] >= 6
    assert result["current"]["capacity_rps"]["Llama-3-70B"] > 0
    moved = [m for m in result["moves"] if any(r["model"] == "Llama-3-70B" for r in m["start"])]
    assert moved and result["cost"]["replicas_started"] >= len(moved) and result["cost"]["capacity_back_s"] > 0
    figures = result["evaluation"]["proposed"]["Llama-3-70B"]
    assert figures["attainment"] >= 0.9 and figures["requests"] > 0
    # Adding servers: they are planned for too.
    added = client.post(
        "/api/placement/plan",
        {"add": {"gpu": "L40S", "count": 2, "gpus": 8, "rack": "rack-d"}, "evaluate": False},
        content_type="application/json",
        **token,
    ).json()
    assert added["proposed"]["servers"] == added["current"]["servers"] + 2 and "evaluation" not in added
    # Bad what-ifs are refused naming the field.
    for body, field, words in [
        ({"lose_racks": ["rack-z"]}, "lose_racks", "there is no rack 'rack-z'"),
        ({"add": {"gpu": "B300", "count": 1}}, "add.gpu", "'B300' is not a catalog GPU"),
        ({"add": {"gpu": "L40S", "count": 1000}}, "add.count", "between 1 and 256"),
        ({"lose_racks": "rack-a"}, "lose_racks", "a list of rack names"),
        ({"lose_racks": ["rack-a", "rack-b", "rack-c"]}, "lose_racks", "no server would be left"),
    ]:
        response = client.post("/api/placement/plan", body, content_type="application/json", **token)
        assert response.status_code == 400, body
        error = response.json()["error"]
        assert error["field"] == field and words in error["message"]


def test_with_no_node_the_page_and_the_api_say_so(client, cast, token):
    client.force_login(cast["manager"])
    assert 'id="placement-empty"' in client.get("/placement/").content.decode()
    response = client.post("/api/placement/plan", {}, content_type="application/json", **token)
    assert response.status_code == 400 and "no serving node yet" in response.json()["error"]["message"]
