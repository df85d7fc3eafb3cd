"""The Django admin: a window onto the records, not a side door.

State that has rules (a node's lifecycle, health, breaker, cordon, spare
status; the cluster's degradation level and breaker) is read-only here: it
changes through the actions, which check the old state and write the
transition rows. The cluster's settings are editable, and saved through the
same action as the settings page, audited.
"""

from django.contrib import admin

from recovery import roles
from recovery.actions import cluster_settings, slo
from recovery.forms import ModelCapacityForm, SettingsForm, SloCorrectionForm, SloObjectiveForm
from recovery.models import (
    ApiKey,
    AuditEntry,
    Cluster,
    Gpu,
    HistoryBackfill,
    ModelCapacity,
    Node,
    NodeTransition,
    Rack,
    ReactionFailure,
    SloCorrection,
    SloObjective,
    SloRollup,
)


class GpuInline(admin.TabularInline):
    model = Gpu
    extra = 0
    readonly_fields = ("index", "uuid", "name", "memory_bytes")
    can_delete = False


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = (
        "name",
        "rack",
        "state",
        "health",
        "breaker",
        "cordoned",
        "spare",
        "model_key",
        "gpu_key",
        "tp",
        "address",
        "state_changed_at",
    )
    list_filter = ("state", "health", "rack", "model_key")
    search_fields = ("name", "address", "host")
    inlines = [GpuInline]

    def get_readonly_fields(self, request, obj=None):
        return [f.name for f in Node._meta.fields]  # every change has its action (and its transition row)

    def has_add_permission(self, request):
        return False  # nodes register themselves

    def has_delete_permission(self, request, obj=None):
        return False  # a node that left keeps its history


class ReadOnlyAdmin(admin.ModelAdmin):
    """Append-only records: the audit log and the timelines."""

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(NodeTransition)
class NodeTransitionAdmin(ReadOnlyAdmin):
    list_display = ("node", "old_state", "new_state", "at", "actor", "cause")
    list_filter = ("new_state", "actor")
    search_fields = ("node__name", "cause")


@admin.register(ReactionFailure)
class ReactionFailureAdmin(ReadOnlyAdmin):
    list_display = ("outbox", "row_id", "tries", "first_at", "next_try_at", "gave_up_at", "error")
    list_filter = ("outbox",)


@admin.register(AuditEntry)
class AuditEntryAdmin(ReadOnlyAdmin):
    list_display = ("at", "actor", "action", "target", "reason")
    list_filter = ("action",)
    search_fields = ("actor", "target", "reason")


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    """Keys are created on the console's keys page or with `manage.py create_api_key` (the secret is shown once)."""

    list_display = ("prefix", "tenant", "tier", "label", "created_at", "revoked_at")
    list_filter = ("tier",)
    readonly_fields = ("prefix", "digest", "tenant", "tier", "created_at", "revoked_at", "created_by")

    def has_add_permission(self, request):
        return False


@admin.register(Cluster)
class ClusterAdmin(admin.ModelAdmin):
    form = SettingsForm
    readonly_fields = ("name", "degradation_level", "degradation_changed_at", "breaker", "control_plane_started_at")

    @admin.display(description="degradation level (the fleet's worst)")
    def degradation_level(self, obj):
        return obj.state.degradation_level

    @admin.display(description="degradation changed at")
    def degradation_changed_at(self, obj):
        return obj.state.degradation_changed_at

    @admin.display(description="automatic cordons")
    def breaker(self, obj):
        state = obj.state
        return f"stopped: {state.auto_cordon_breaker_reason}" if state.auto_cordon_breaker_open else "allowed"

    @admin.display(description="control plane started at")
    def control_plane_started_at(self, obj):
        return obj.state.control_plane_started_at

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    def save_model(self, request, obj, form, change):
        values = {name: form.cleaned_data[name] for name in form.changed_data if name in cluster_settings.FIELDS}
        cluster_settings.update(Cluster.objects.get(pk=obj.pk), values, request.user.get_username(), "Django admin")


@admin.register(ModelCapacity)
class ModelCapacityAdmin(admin.ModelAdmin):
    """Each model's capacity objective, saved through recovery.actions.cluster_settings (validated, audited); its
    level is the control plane's."""

    form = ModelCapacityForm
    list_display = ("model_key", "required_rps", "ttft_ms", "tpot_ms", "degradation_level", "degradation_changed_at")
    readonly_fields = ("model_key", "degradation_level", "degradation_changed_at")

    def has_add_permission(self, request):
        return False  # a row per served model, made as its nodes register

    def has_delete_permission(self, request, obj=None):
        return False

    def save_model(self, request, obj, form, change):
        values = {name: form.cleaned_data[name] for name in form.changed_data if name in cluster_settings.MODEL_FIELDS}
        cluster_settings.update_model(obj.cluster, obj.model_key, values, request.user.get_username(), "Django admin")


class SloAdmin(admin.ModelAdmin):
    """Objectives and corrections: saved through recovery.actions.slo (validated, audited); admins only."""

    def has_change_permission(self, request, obj=None):
        return roles.has_role(request.user, roles.ADMIN)

    def has_add_permission(self, request):
        return roles.has_role(request.user, roles.ADMIN)

    def has_delete_permission(self, request, obj=None):
        return roles.has_role(request.user, roles.ADMIN)


@admin.register(SloObjective)
class SloObjectiveAdmin(SloAdmin):
    form = SloObjectiveForm
    list_display = (*SloObjectiveForm.Meta.fields, "updated_by")
    list_filter = ("tier", "window", "model_key")

    def save_model(self, request, obj, form, change):
        values = {name: form.cleaned_data[name] for name in slo.OBJECTIVE_FIELDS}
        if change:
            slo.update_objective(
                SloObjective.objects.get(pk=obj.pk), values, request.user.get_username(), "Django admin"
            )
        else:
            obj.pk = slo.create_objective(values, request.user.get_username(), "Django admin").pk

    def delete_model(self, request, obj):
        slo.delete_objective(obj, request.user.get_username(), "Django admin")

    def delete_queryset(self, request, queryset):
        for obj in queryset:
            self.delete_model(request, obj)


@admin.register(SloCorrection)
class SloCorrectionAdmin(SloAdmin):
    form = SloCorrectionForm
    list_display = ("start", "end", "model_key", "tier", "reason", "created_by")

    def has_change_permission(self, request, obj=None):
        return False  # add one, or withdraw it: a correction is never quietly moved

    def save_model(self, request, obj, form, change):
        values = {name: form.cleaned_data[name] for name in SloCorrectionForm.Meta.fields}
        obj.pk = slo.add_correction(values, request.user.get_username()).pk

    def delete_model(self, request, obj):
        slo.withdraw_correction(obj, request.user.get_username(), "Django admin")

    def delete_queryset(self, request, queryset):
        for obj in queryset:
            self.delete_model(request, obj)


@admin.register(SloRollup)
class SloRollupAdmin(ReadOnlyAdmin):
    list_display = ("minute", "model_key", "tier", "tenant", "valid", "good", "ttft_good", "tpot_good", "shed")
    list_filter = ("tier", "model_key")


@admin.register(HistoryBackfill)
class HistoryBackfillAdmin(ReadOnlyAdmin):
    """The demo's generated history: when it ran, how long it took, what it wrote (recovery.actions.history)."""

    list_display = ("window_start", "window_end", "days_done", "days", "work_s", "started_at", "finished_at")


admin.site.register(Rack)
