from django.urls import path

from console import consumers

websocket_urlpatterns = [
    path("ws/cluster/", consumers.ClusterConsumer.as_asgi()),
]
