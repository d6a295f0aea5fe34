"""Checking what a key's scopes name, where keys are edited (admin, `create_api_key`), never per request.

Scopes name models and LoRA adapters by public name or alias. A key scoped
to a base model does not reach its adapters unless it names them too (least
privilege: an adapter is another model, often a customer's fine-tune, and
adding one to the catalog must not widen the keys already issued; DESIGN
"LoRA adapters"). They are checked against the catalog's rows: keys sit above the catalog in the control plane's layers
(tests/test_layers.py). A deployment with an empty catalog (router-only mode:
models exist only as `manage.py router --endpoint` names) accepts any name.
"""

from __future__ import annotations

from catalog.models import Adapter, Alias, Model


def parse_names(text: str) -> list[str]:
    """`"a, b,,a"` -> `["a", "b"]`: comma-separated names, trimmed, empty and repeated ones dropped."""
    names: list[str] = []
    for part in text.split(","):
        name = part.strip()
        if name and name not in names:
            names.append(name)
    return names


def catalog_names() -> set[str] | None:
    """Every model name, adapter name and alias in the catalog; None when the catalog has no models
    (router-only mode)."""
    model_names = set(Model.objects.values_list("name", flat=True))
    if not model_names:
        return None
    adapters = Adapter.objects.values_list("name", "aliases")
    adapter_names = {name for adapter, aliases in adapters for name in (adapter, *(aliases or ()))}
    return model_names | set(Alias.objects.values_list("name", flat=True)) | adapter_names


def unknown_models(names: list[str]) -> list[str]:
    """The names the catalog knows neither as a model, an adapter nor an alias (none when the catalog is empty)."""
    known = catalog_names()
    if known is None:
        return []
    return [name for name in names if name not in known]


def unknown_models_message(unknown: list[str]) -> str:
    """One sentence naming the unknown models and where the known ones are listed."""
    listed = ", ".join(f"`{name}`" for name in unknown)
    noun = "model" if len(unknown) == 1 else "models"
    return f"unknown {noun} {listed}: name models, adapters or aliases from the catalog (see the admin's Models page)"
