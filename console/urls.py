from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path

from console import views

urlpatterns = [
    path("", views.home, name="home"),
    path("cluster/", views.cluster, name="cluster"),
    path("incidents/", views.incident_list, name="incidents"),
    path("incidents/<int:incident_id>/", views.incident_page, name="incident"),
    path("incidents/<int:incident_id>/<str:action>", views.incident_action, name="incident-action"),
    path("checkpoints/", views.checkpoints, name="checkpoints"),
    path("keys/", views.api_keys, name="keys"),
    path("keys/<int:key_id>/revoke", views.revoke_key, name="key-revoke"),
    path("nodes/<str:name>/", views.node_page, name="node"),
    path("nodes/<str:name>/<str:action>", views.node_action, name="node-action"),
    path("api/cluster", views.api_cluster, name="api-cluster"),
    path("api/incidents", views.api_incidents, name="api-incidents"),
    path("api/incidents/<int:incident_id>", views.api_incident, name="api-incident"),
    path("api/checkpoints", views.api_checkpoints, name="api-checkpoints"),
    path("api/nodes/<str:name>/faults", views.api_node_fault, name="api-node-fault"),
    path("api/nodes/<str:name>/migrate", views.api_node_migrate, name="api-node-migrate"),
    path("api/migrations/<str:command>", views.api_migration, name="api-migration"),
    path("healthz", views.healthz, name="healthz"),
    path("login/", auth_views.LoginView.as_view(redirect_authenticated_user=True), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("admin/", admin.site.urls),
    path("", include("recovery.urls")),
]
