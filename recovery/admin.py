from django.contrib import admin

from recovery.models import ApiKey, Cluster, Gpu, Node, NodeTransition, Rack


class GpuInline(admin.TabularInline):
    model = Gpu
    extra = 0
    readonly_fields = ("index", "uuid", "name", "memory_bytes")


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ("name", "rack", "state", "model_key", "gpu_key", "tp", "address", "state_changed_at")
    list_filter = ("state", "rack", "model_key")
    search_fields = ("name", "address", "host")
    readonly_fields = ("state", "state_changed_at", "session", "registered_at", "session_started_at", "last_seen_at")
    inlines = [GpuInline]


@admin.register(NodeTransition)
class NodeTransitionAdmin(admin.ModelAdmin):
    list_display = ("node", "old_state", "new_state", "at", "actor", "cause")
    list_filter = ("new_state", "actor")
    search_fields = ("node__name", "cause")

    def has_change_permission(self, request, obj=None):
        return False  # the audit log is append-only


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ("prefix", "tenant", "tier", "label", "created_at", "revoked_at")
    list_filter = ("tier",)
    readonly_fields = ("prefix", "digest", "created_at")


admin.site.register(Cluster)
admin.site.register(Rack)
