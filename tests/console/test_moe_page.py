"""The MoE page and its API (console/views/moe.py) over a deployment the control plane keeps: expert workers as
tiles, the table as a heatmap, figures; a drain is on-call's, needs a reason, and moves the EW's experts to their
shadows; a deployment that does not exist is a 404 naming where to look."""

import pytest
from django.test import Client

from recovery.actions import moe
from recovery.models import AuditEntry, MoeDeployment
from recovery.policy import moe as moe_policy
from workers import catalog
from workers.moe import expert_bytes

MIXTRAL = catalog.MODELS["Mixtral-8x7B"]


@pytest.fixture
def deployment(db):
    table = moe_policy.plan(MIXTRAL, [moe_policy.ExpertWorker(f"ew-{i}", expert_bytes(MIXTRAL) * 4) for i in range(4)])
    ews = {ew: f"http://127.0.0.1:{9 + i}" for i, ew in enumerate(sorted(table.ews()))}  # nothing listens there
    return moe.register("mixtral-moe", "Mixtral-8x7B", ews, ["node-aw1"], table, standby={"ew-9": "http://127.0.0.1:8"})


def client_for(cast, role: str) -> Client:
    client = Client()
    client.force_login(cast[role])
    return client


def test_the_page_shows_every_ew_and_the_table_as_a_heatmap(cast, deployment):
    client = client_for(cast, "manager")
    assert client.get("/moe/")["Location"] == "/moe/mixtral-moe/"
    page = client.get("/moe/mixtral-moe/").content.decode()
    for ew in ("ew-0", "ew-1", "ew-2", "ew-3", "ew-9"):
        assert f'id="ew-{ew}"' in page
    assert 'id="moe-heatmap"' in page and "Experts with a shadow" in page and "100%" in page
    assert '/drain"' not in page  # a manager reads; on-call drains
    data = client.get("/api/moe/mixtral-moe").json()
    table = moe.table(deployment)
    assert data["version"] == 1 and data["ew_names"] == ["ew-0", "ew-1", "ew-2", "ew-3", "ew-9"]
    for expert, row in enumerate(data["heatmap"]):
        for ew, value in zip(data["ew_names"], row, strict=True):
            expected = 2 if ew in table.experts[expert].primaries else 1 if ew in table.experts[expert].shadows else 0
            assert value == expected
    assert data["shadow_coverage"] == 1.0 and data["shadow_bytes"] == 8 * expert_bytes(MIXTRAL)
    status = client.get("/api/moe/nothing")
    assert status.status_code == 404 and "/moe/" in status.json()["error"]["message"]
    assert status.json()["error"]["field"] == "name"


def test_on_call_drains_an_ew_onto_its_shadows_with_a_reason(cast, deployment):
    oncall = client_for(cast, "oncall")
    assert "/moe/mixtral-moe/ews/ew-1/drain" in oncall.get("/moe/mixtral-moe/").content.decode()
    refused = oncall.post("/moe/mixtral-moe/ews/ew-1/drain", {"reason": ""}, follow=True).content.decode()
    assert "say why" in refused and moe.table(MoeDeployment.objects.get()).version == 1
    assert client_for(cast, "operator").post("/moe/mixtral-moe/ews/ew-1/drain", {"reason": "x"}).status_code == 403
    done = oncall.post("/moe/mixtral-moe/ews/ew-1/drain", {"reason": "HBM errors"}, follow=True).content.decode()
    table = moe.table(MoeDeployment.objects.get())
    assert "ew-1 drained" in done and table.version == 2 and "ew-1" not in table.ews()
    assert AuditEntry.objects.filter(action="moe_drain", actor="oncall", reason="HBM errors").exists()


def test_with_no_deployment_the_page_says_how_to_start_one(cast):
    page = client_for(cast, "operator").get("/moe/").content.decode()
    assert "./lifeline run --moe" in page
