"""The MoE page's read model: what an operator reads of a deployment's workers."""

from console.readmodels.moe import _aw_state
from recovery.models import Node


def test_an_attention_worker_is_serving_only_while_it_serves_in_routing():
    """Issue 43: an unhealthy attention worker was listed as "serving"."""
    assert _aw_state(Node(state="serving", health="healthy")) == "serving"
    assert _aw_state(Node(state="serving", health="suspicious")) == "serving, suspicious"
    assert _aw_state(Node(state="serving", health="unhealthy")) == "serving, unhealthy: out of routing"
    assert _aw_state(Node(state="serving", health="draining")) == "serving, draining: out of routing"
    assert _aw_state(Node(state="down", health="healthy")) == "down"
