from django.urls import path

from recovery import views

# What every node sends every second: the web process's ASGI application answers it before Django's middleware
# (console.asgi.NodeEndpoint), with the same view.
HEARTBEAT = "api/nodes/<str:name>/heartbeat"
REGISTER = "api/nodes/register"
DEREGISTER = "api/nodes/<str:name>/deregister"

urlpatterns = [
    path(REGISTER, views.register, name="node-register"),
    path(HEARTBEAT, views.heartbeat, name="node-heartbeat"),
    path(DEREGISTER, views.deregister, name="node-deregister"),
]
