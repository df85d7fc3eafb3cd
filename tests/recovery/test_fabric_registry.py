"""A node's place in the fabric goes from its registration into the routing table every gateway reads."""

import pytest
from django.conf import settings

from recovery import hot
from recovery.models import Node
from tests.recovery.test_registry import beat, registration

pytestmark = pytest.mark.django_db


@pytest.fixture
def serve(client, django_capture_on_commit_callbacks):
    """Register a node and beat once, as a node joining the routing table does; the registration's answer."""
    headers = {"HTTP_AUTHORIZATION": f"Bearer {settings.LIFELINE_NODE_TOKEN}"}

    def node_api(path, body):
        return client.post(path, body, content_type="application/json", **headers)

    def start(body):
        with django_capture_on_commit_callbacks(execute=True):
            response = node_api("/api/nodes/register", body)
        if response.status_code == 200:
            with django_capture_on_commit_callbacks(execute=True):
                beat(node_api, body["name"], body["session"])
        return response

    return start


def test_a_registered_place_in_the_fabric_reaches_the_routing_table(serve):
    assert serve(registration("fab-a", server="tray-3", nvl_domain="nvl72-a", network="roce")).status_code == 200
    node = Node.objects.get(name="fab-a")
    assert (node.server, node.nvl_domain, node.network) == ("tray-3", "nvl72-a", "roce")
    entry = hot.routing_table()["fab-a"]
    assert (entry["server"], entry["nvl_domain"], entry["network"]) == ("tray-3", "nvl72-a", "roce")


def test_a_node_from_before_the_fabric_registers_as_alone_on_infiniband(serve):
    assert serve(registration("fab-old")).status_code == 200
    entry = hot.routing_table()["fab-old"]
    assert (entry["server"], entry["nvl_domain"], entry["network"]) == ("", "", "infiniband")


def test_a_bad_network_is_refused_by_name(serve):
    response = serve(registration("fab-bad", network="ethernet"))
    assert response.status_code == 400 and "network" in str(response.json())
