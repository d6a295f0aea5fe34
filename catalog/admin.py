"""Catalog admin: models with their aliases and profiles inline, validated before anything is saved."""

from django import forms
from django.contrib import admin
from django.core.exceptions import ValidationError

from .models import Alias, Model, Profile, name_clash


class AliasForm(forms.ModelForm):
    """Names the clash when an alias is already taken, instead of the generic uniqueness error."""

    class Meta:
        model = Alias
        fields = ["name"]

    def clean_name(self):
        name = self.cleaned_data["name"]
        clash = name_clash(name, models=False, alias_pk=self.instance.pk)
        if clash is not None:
            raise ValidationError(clash)
        return name


class AliasFormSet(forms.BaseInlineFormSet):
    """Catches an alias equal to its own model's name, which neither row's clean() can see
    while the model is being added in the same form."""

    def clean(self):
        super().clean()
        model_name = self.instance.name
        for form in self.forms:
            if not hasattr(form, "cleaned_data") or form.cleaned_data.get("DELETE"):
                continue
            name = form.cleaned_data.get("name")
            clash = name_clash(name, own_model_name=model_name, models=False, aliases=False) if name else None
            if clash is not None:
                form.add_error("name", clash)


class AliasInline(admin.TabularInline):
    model = Alias
    form = AliasForm
    formset = AliasFormSet
    extra = 1


class ProfileInline(admin.StackedInline):
    """A model's profiles: alternatives tried in order (lowest first); the first sets the model's demand."""

    model = Profile
    extra = 0
    fields = [
        ("order", "engine"),
        ("gpu_class", "gpus_per_node", "nodes_per_replica"),
        ("min_replicas", "max_replicas", "target_concurrency"),
        ("priority", "pool", "weight", "idle_timeout_seconds"),
        "engine_args",
    ]


@admin.register(Model)
class ModelAdmin(admin.ModelAdmin):
    list_display = ["name", "enabled", "source", "alias_names", "profile_count", "updated_at"]
    list_filter = ["enabled"]
    search_fields = ["name", "aliases__name", "source"]
    inlines = [AliasInline, ProfileInline]

    def get_queryset(self, request):
        return super().get_queryset(request).prefetch_related("aliases", "profiles")

    @admin.display(description="aliases")
    def alias_names(self, obj):
        return ", ".join(a.name for a in obj.aliases.all()) or "-"

    @admin.display(description="profiles")
    def profile_count(self, obj):
        return len(obj.profiles.all())


@admin.register(Alias)
class AliasAdmin(admin.ModelAdmin):
    list_display = ["name", "model"]
    search_fields = ["name", "model__name"]
    list_select_related = ["model"]
    form = AliasForm
    fields = ["model", "name"]

    def get_form(self, request, obj=None, change=False, **kwargs):
        kwargs["fields"] = ["model", "name"]
        return super().get_form(request, obj, change, **kwargs)


@admin.register(Profile)
class ProfileAdmin(admin.ModelAdmin):
    list_display = [
        "model",
        "order",
        "engine",
        "gpu_class",
        "gpus_per_node",
        "nodes_per_replica",
        "min_replicas",
        "max_replicas",
        "target_concurrency",
        "priority",
        "idle_timeout_seconds",
        "pool",
        "start_seconds",
    ]
    list_filter = ["engine", "gpu_class", "pool"]
    search_fields = ["model__name", "gpu_class"]
    list_select_related = ["model"]
