"""Router admin: API keys are created from a name, shown once, and revoked; only their hash is stored."""

from django.contrib import admin, messages

from .models import ApiKey, TokenUsage


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ["name", "prefix", "active", "created_at"]
    list_filter = ["active"]
    search_fields = ["name", "prefix"]
    actions = ["revoke"]

    def get_fields(self, request, obj=None):
        if obj is None:
            return ["name"]
        return ["name", "prefix", "active", "created_at"]

    def get_readonly_fields(self, request, obj=None):
        return [] if obj is None else ["prefix", "created_at"]

    def save_model(self, request, obj, form, change):
        if change:
            return super().save_model(request, obj, form, change)
        issued, plaintext = ApiKey.issue(form.cleaned_data["name"])
        # The admin goes on to log and redirect with `obj`, so it becomes the issued row.
        for field in ApiKey._meta.concrete_fields:
            setattr(obj, field.attname, getattr(issued, field.attname))
        obj._state.adding = False
        self.message_user(
            request,
            f"API key for “{issued.name}”: {plaintext} — copy it now; it is stored hashed and will not be shown again.",
            messages.WARNING,
        )

    @admin.action(description="Revoke the selected keys", permissions=["change"])
    def revoke(self, request, queryset):
        count = queryset.update(active=False)
        self.message_user(request, f"Revoked {count} key(s).", messages.SUCCESS)


@admin.register(TokenUsage)
class TokenUsageAdmin(admin.ModelAdmin):
    """Tokens per key, model and hour, as the control plane stored them from the routers' counts: read-only."""

    list_display = ["hour", "key_name", "model", "requests", "prompt_tokens", "completion_tokens"]
    list_filter = ["key_name", "model"]
    search_fields = ["key_name", "model"]
    date_hierarchy = "hour"
    list_select_related = False

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
