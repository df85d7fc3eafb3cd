from django.urls import path

from recovery import views

urlpatterns = [
    path("api/nodes/register", views.register, name="node-register"),
    path("api/nodes/<str:name>/heartbeat", views.heartbeat, name="node-heartbeat"),
    path("api/nodes/<str:name>/deregister", views.deregister, name="node-deregister"),
]
