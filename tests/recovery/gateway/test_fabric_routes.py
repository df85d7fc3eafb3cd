"""The gateway's routes carry each node's place in the fabric to recovery and migration decisions."""

import json
import os
import secrets

from recovery.gateway.coordinator import Coordinator
from recovery.gateway.table import RoutingView
from workers.catalog import Placement

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
ENTRY = {"address": "http://10.0.0.1:8200", "model": "Qwen3-32B", "gpu": "H100-SXM", "tp": 2, "weight": 1.0}


async def test_routes_read_from_redis_carry_the_fabric_and_older_entries_keep_todays_placement():
    view = RoutingView(REDIS_URL, f"test-fabric-{secrets.token_hex(4)}")
    placed = {**ENTRY, "rack": "rack-a", "server": "tray-1", "nvl_domain": "nvl72-a", "network": "roce"}
    old = {**ENTRY, "rack": "rack-b"}  # as a control plane from before the fabric was modelled wrote it
    try:
        await view.redis.hset(view.keys.routing, mapping={"placed": json.dumps(placed), "old": json.dumps(old)})
        await view.reload()
        assert view.routes["placed"].placement == Placement("rack-a", "tray-1", "nvl72-a", "roce")
        assert view.routes["old"].placement == Placement("rack-b")
        # What a node is told of its migration target or a holder: enough to time the link to it.
        assert view.routes["placed"].peer() == {
            "name": "placed",
            "address": "http://10.0.0.1:8200",
            "rack": "rack-a",
            "server": "tray-1",
            "nvl_domain": "nvl72-a",
            "network": "roce",
        }
        survivor = Coordinator(view, None, "gw-test", {}).survivor(view.routes["placed"])
        assert survivor.placement == Placement("rack-a", "tray-1", "nvl72-a", "roce")
    finally:
        await view.redis.delete(view.keys.routing)
        await view.redis.aclose()
