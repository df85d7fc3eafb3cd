from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path

from console import views

urlpatterns = [
    path("", views.home, name="home"),
    path("cluster/", views.cluster, name="cluster"),
    path("api/cluster", views.api_cluster, name="api-cluster"),
    path("healthz", views.healthz, name="healthz"),
    path("login/", auth_views.LoginView.as_view(redirect_authenticated_user=True), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("admin/", admin.site.urls),
    path("", include("recovery.urls")),
]
