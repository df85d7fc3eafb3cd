"""The shared stack's put-back (tests/conftest.py SharedStack, DemoStack.put_back), on the real stack: what a module
leaves behind (a node corrupt and taken out with its drain waiting, a node killed, settings changed) is whole again
before the next module, and what is not back in time fails loudly, naming it."""

import os
import signal

import pytest

from tests.helpers import wait_for

pytestmark = pytest.mark.e2e


def test_put_back_withdraws_drains_clears_faults_waits_for_every_node_and_restores_the_settings(demo_stack):
    stack = demo_stack
    baseline = stack.baseline()
    fast = {"canary_interval_s": 5, "canary_retry_s": 0.5, "auto_cordon_max_share": 1, "reason": "put-back test"}
    assert stack.call("PATCH", "/api/settings", fast)[0] == 200
    sdc = {"kind": "sdc", "rate": 0.0, "logprob_drift": -1.5, "reason": "put-back test"}
    status, answer = stack.call("POST", "/api/nodes/node-02/faults", sdc)
    assert status == 200, answer

    def waiting() -> dict | None:
        drains = stack.call("GET", "/api/drains")[1]["drains"]
        return next((d for d in drains if d["node"] == "node-02" and d["waiting"]), None)

    drain = wait_for(waiting, 30, 0.2, "node-02's drain proposed")
    assert stack.node("node-02")["health"] == "unhealthy"
    os.kill(stack.node("node-03")["pid"], signal.SIGKILL)
    wait_for(lambda: stack.node("node-03")["state"] == "down", 10, 0.1, "node-03 seen down")

    # Not back in a second (node-03 restarts 6 s after its death): it says what is not, and why.
    with pytest.raises(AssertionError) as late:
        stack.put_back(baseline, timeout_s=1)
    assert "not put back in 1 s" in str(late.value) and "node-03 is not back: {'state': 'down'" in str(late.value)

    stack.put_back(baseline)
    assert stack._not_back(baseline) == []
    assert stack.call("GET", "/api/settings")[1]["canary_interval_s"] == baseline["settings"]["canary_interval_s"]
    assert stack.call("GET", f"/api/drains/{drain['id']}")[1]["state"] == "cancelled"
    assert stack.node("node-02")["health"] == "healthy" and stack.node("node-03")["state"] == "serving"
