"""Catalog admin: models with their aliases, profiles and adapters inline, validated before anything is saved."""

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.utils.html import escape, format_html
from django.utils.safestring import mark_safe

from catalog.models import (
    PRICE_FIELDS,
    PROFILE_FIELD_ROWS,
    PROFILE_FIELDS,
    Adapter,
    Alias,
    Model,
    Profile,
    name_clash,
)
from catalog.prices import price_text
from catalog.rules import keep_stored_secrets
from catalog.sizing import fit_warnings, fleet_memory, profile_verdict
from nodewire.engine_env import masked, shown

# The GPU classes nodes report. The catalog sits below inventory in the stack, so inventory's admin
# plugs its query in here (set_gpu_class_source) rather than the catalog importing it.
_gpu_classes: Callable[[], list[str]] = list


def set_gpu_class_source(source: Callable[[], list[str]]) -> None:
    """Where the profile form gets the GPU classes it offers (and warns about a class no node has)."""
    global _gpu_classes
    _gpu_classes = source


def unknown_gpu_classes(profiles: Iterable[Profile]) -> list[str]:
    """The profiles' GPU classes that no node reports, sorted."""
    known = set(_gpu_classes())
    return sorted({p.gpu_class for p in profiles if p.gpu_class not in known})


def warn_unknown_gpu_classes(request, profiles: Iterable[Profile]) -> None:
    """Saved anyway (nodes may join later), but said: a typo would otherwise leave the model unplaceable."""
    for gpu_class in unknown_gpu_classes(profiles):
        messages.warning(
            request,
            f"No node reports GPU class “{gpu_class}” (known: {', '.join(_gpu_classes()) or 'none yet'}); "
            "replicas on it cannot be placed until such a node joins. Check the spelling.",
        )


def warn_does_not_fit(request, profiles: Iterable[Profile], *, numbered: bool = True) -> None:
    """Saved anyway (the estimate may be off, the fleet may change), but said with the numbers: placement will
    not put a profile on GPUs its memory estimate exceeds."""
    rows = sorted(profiles, key=lambda p: (p.order, p.pk or 0))
    for warning in fit_warnings(rows, fleet_memory(), numbered=numbered):
        messages.warning(request, f"Memory: {warning}")


class GPUClassInput(forms.TextInput):
    """Free text with the classes nodes report offered as suggestions (an HTML datalist)."""

    def render(self, name, value, attrs=None, renderer=None):
        list_id = f"{(attrs or {}).get('id') or name}_classes"
        html = super().render(name, value, {**(attrs or {}), "list": list_id}, renderer)
        options = "".join(f'<option value="{escape(c)}">' for c in _gpu_classes())
        return mark_safe(f'{html}<datalist id="{list_id}">{options}</datalist>')


class EngineEnvField(forms.JSONField):
    """A profile's engine env as JSON, the value of every secret name shown as the mask, never in plain text.

    The stored value is the field's initial, so handing the mask back counts as no change.
    """

    def prepare_value(self, value):
        return super().prepare_value(masked(value) if isinstance(value, dict) else value)

    def has_changed(self, initial, data):
        try:
            value = self.to_python(data)
        except ValidationError:
            return True
        if isinstance(value, dict) and isinstance(initial, dict):
            value, _ = keep_stored_secrets(value, initial)
        return super().has_changed(initial, value)


class ProfileForm(forms.ModelForm):
    """A profile, its GPU class suggested from what nodes report and its secret env values masked."""

    class Meta:
        model = Profile
        exclude: list[str] = []  # every editable field; the admins choose which to show
        widgets = {"gpu_class": GPUClassInput}
        field_classes = {"env": EngineEnvField}

    def clean_env(self):
        # An emptied box means no variables; a secret left as the mask keeps the value stored.
        env, problem = keep_stored_secrets(self.cleaned_data["env"] or {}, self.instance.env or {})
        if problem is not None:
            raise ValidationError(problem)
        return env


# The mixin's base as the type checker sees it: it is only ever mixed into a ModelAdmin.
if TYPE_CHECKING:
    _AdminBase = admin.ModelAdmin[Any]
else:
    _AdminBase = object


class EnvShownMasked(_AdminBase):
    """For ModelAdmins showing profiles: to a user who may view but not change them, the engine env is
    shown masked (a read-only JSON field would print every value)."""

    def _env_read_only(self, request, obj) -> bool:
        # An add form (no obj) is editable, and its env field masks by itself.
        return obj is not None and not self.has_change_permission(request, obj)

    def get_fields(self, request, obj=None):
        fields = super().get_fields(request, obj)
        if not self._env_read_only(request, obj):
            return fields

        def swap(name: str) -> str:
            return "masked_env" if name == "env" else name

        return [swap(row) if isinstance(row, str) else tuple(swap(f) for f in row) for row in fields]

    def get_readonly_fields(self, request, obj=None):
        fields = list(super().get_readonly_fields(request, obj))
        return [*fields, "masked_env"] if self._env_read_only(request, obj) else fields

    @admin.display(description="engine env")
    def masked_env(self, obj) -> str:
        return shown(dict(sorted(obj.env.items()))) or "-"  # by name: jsonb keeps no insertion order


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


class ProfileInline(EnvShownMasked, admin.StackedInline):
    """A model's profiles: alternatives tried in order (lowest first); the first sets the model's demand."""

    model = Profile
    form = ProfileForm
    # The position leads the first row; then the profile's own fields as the catalog lists them.
    fields = [("order", *PROFILE_FIELD_ROWS[0]), *PROFILE_FIELD_ROWS[1:], "memory"]
    readonly_fields = ["memory"]
    _fleet: dict[str, int] | None = None

    @admin.display(description="memory per GPU")
    def memory(self, obj) -> str:
        """The saved profile's figures per GPU on its class (needs, usable, full-length sequences that fit), then
        the verdict's sentence ("size unknown (…)" when the weights' size is not known)."""
        if obj is None or obj.pk is None:
            return "-"
        if self._fleet is None:
            self._fleet = fleet_memory()  # one query per page, not per profile
        judged = profile_verdict(obj, self._fleet)
        if judged is None:
            return f"no verdict: the memory of GPU class {obj.gpu_class} is not known (no agent reports it)"
        needs = "-" if judged.needs_gib is None else f"{judged.needs_gib} GiB"
        sequences = "-" if judged.sequences is None else str(judged.sequences)
        return format_html(
            "verdict: <strong>{}</strong> · needs {} per GPU · {} GiB usable per {} GPU · full-length sequences that"
            " fit: {}<br>{}: {}",
            judged.fit,
            needs,
            judged.usable_gib,
            obj.gpu_class,
            sequences,
            judged.fit,
            judged.sentence,
        )

    def get_formset(self, request, obj=None, **kwargs):
        self._fleet = None  # read afresh for each page
        return super().get_formset(request, obj, **kwargs)

    def get_extra(self, request, obj=None, **kwargs):
        # One empty profile to fill in on the add page: a model without one cannot be served.
        return 1 if obj is None else 0


class AdapterInline(admin.TabularInline):
    """A model's LoRA adapters (Adapter.clean() checks its profiles take them: save those first)."""

    model = Adapter
    fields = ["name", "source", "enabled", "rank", "aliases", *PRICE_FIELDS]
    extra = 0


@admin.register(Model)
class ModelAdmin(admin.ModelAdmin):
    list_display = [
        "name",
        "enabled",
        "source",
        "alias_names",
        "profile_count",
        "adapter_count",
        "price",
        "updated_at",
    ]
    list_filter = ["enabled"]
    search_fields = ["name", "aliases__name", "adapters__name", "source"]
    inlines = [AliasInline, ProfileInline, AdapterInline]

    def get_queryset(self, request):
        return super().get_queryset(request).prefetch_related("aliases", "profiles", "adapters")

    def get_fieldsets(self, request, obj=None):
        # Every other field as Django lists them (a new one shows up by itself), then the prices side by side.
        fields = [name for name in self.get_fields(request, obj) if name not in PRICE_FIELDS]
        price = {
            "fields": [PRICE_FIELDS],
            "description": "Per million tokens, in the organisation's own currency unit; 0 = free. "
            "Adapters left empty cost what this model costs.",
        }
        return [(None, {"fields": fields}), ("Price", price)]

    def save_related(self, request, form, formsets, change):
        super().save_related(request, form, formsets, change)
        warn_unknown_gpu_classes(request, form.instance.profiles.all())
        warn_does_not_fit(request, form.instance.profiles.all())

    @admin.display(description="aliases")
    def alias_names(self, obj):
        return ", ".join(a.name for a in obj.aliases.all()) or "-"

    @admin.display(description="profiles")
    def profile_count(self, obj):
        return len(obj.profiles.all())

    @admin.display(description="adapters")
    def adapter_count(self, obj):
        return len(obj.adapters.all())

    @admin.display(description="price per million (in / out)")
    def price(self, obj) -> str:
        prices = obj.prices
        if not prices.input_per_million and not prices.output_per_million:
            return "free"
        return f"{price_text(prices.input_per_million)} / {price_text(prices.output_per_million)}"


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
class ProfileAdmin(EnvShownMasked, admin.ModelAdmin):
    # engine_args is free-form JSON, too wide for a column; the env is shown masked; the rest are short values.
    list_display = [
        "model",
        "order",
        *(name for name in PROFILE_FIELDS if name not in ("engine_args", "env")),
        "masked_env",
        "start_seconds",
    ]
    list_filter = ["engine", "gpu_class", "pool"]
    search_fields = ["model__name", "gpu_class"]
    list_select_related = ["model"]
    form = ProfileForm

    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)
        warn_unknown_gpu_classes(request, [obj])
        warn_does_not_fit(request, [obj], numbered=False)
