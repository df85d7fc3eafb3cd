from django.urls import path

from console import consumers

websocket_urlpatterns = [
    path("ws/cluster/", consumers.ClusterConsumer.as_asgi()),
    path("ws/incidents/", consumers.IncidentsConsumer.as_asgi()),
    path("ws/incidents/<int:incident_id>/", consumers.IncidentConsumer.as_asgi()),
    path("ws/checkpoints/", consumers.CheckpointsConsumer.as_asgi()),
    path("ws/status/", consumers.StatusConsumer.as_asgi()),
    path("ws/drains/", consumers.DrainsConsumer.as_asgi()),
    path("ws/drains/<int:drain_id>/", consumers.DrainConsumer.as_asgi()),
    path("ws/nodes/<int:node_id>/", consumers.NodeConsumer.as_asgi()),
    path("ws/moe/", consumers.MoeConsumer.as_asgi()),
]
