"""The dashboard's "Will it fit?" page (/admin/plan/): pick a catalog model or paste catalog-format YAML, see the plan.

Staff only (wrapped in `admin_view` by the site) and CSRF protected like every
admin form. Thin: the form parses, `reconciler.planner.what_if.plan_request` answers,
the template shows the answer's own fields. Nothing is written.
"""

from django import forms
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_http_methods

from catalog.catalog_file import CatalogFileError, load_catalog_text
from catalog.models import Model
from reconciler.planner.what_if import PlanInputError, plan_request

YAML_HELP = "Catalog-format YAML: a `models:` list, or one model's entry (name, source, profiles)."


class WillItFitForm(forms.Form):
    """A catalog model, or catalog-format YAML (one entry or a `models:` list); the YAML is planned first."""

    model = forms.ChoiceField(required=False, label="Catalog model")
    entry = forms.CharField(required=False, label="Or paste YAML", widget=forms.Textarea(attrs={"rows": 12}))

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        names = Model.objects.order_by("name").values_list("name", flat=True)
        # A ChoiceField, declared above; the form's fields are typed as plain fields.
        self.fields["model"].choices = [("", "-"), *((name, name) for name in names)]  # type: ignore[attr-defined]
        self.fields["entry"].help_text = YAML_HELP

    def clean_entry(self):
        text = self.cleaned_data["entry"]
        if not text.strip():
            return None
        try:
            data = load_catalog_text(text)
        except CatalogFileError as exc:
            raise forms.ValidationError(exc.messages) from None
        # One model's entry on its own is the common paste; wrap it as a file's list.
        return {"models": [data]} if isinstance(data, dict) and "models" not in data else data

    def clean(self):
        cleaned = super().clean() or {}
        if not self.errors and not cleaned.get("model") and cleaned.get("entry") is None:
            raise forms.ValidationError("Pick a catalog model or paste a catalog-format YAML entry.")
        return cleaned


@require_http_methods(["GET", "POST"])
@never_cache
def will_it_fit_view(request: HttpRequest, site_context: dict | None = None) -> HttpResponse:
    """The form, and on POST the plan for what it names (errors from the planner shown on the form).

    `site_context` is the admin site's own (its title, the user's links), as every admin page has."""
    form = WillItFitForm(request.POST if request.method == "POST" else None)
    answer = None
    if request.method == "POST" and form.is_valid():
        model = form.cleaned_data["model"]
        try:
            answer = plan_request(form.cleaned_data["entry"], [model] if model else None, timezone.now())
        except PlanInputError as exc:
            form.add_error("entry" if exc.part == "models" else None, exc.messages)
    context = {**(site_context or {}), "title": "Will it fit?", "form": form, "answer": answer}
    return TemplateResponse(request, "dashboard/will_it_fit.html", context)
