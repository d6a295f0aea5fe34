"""The catalog file: YAML text in, the models it asks for out, every problem named at once.

Shape: a mapping with one key, `models:`, a list; each model has `name`,
`source`, `enabled`, optionally `continue_streams` (default true), its size (`parameters_billions`, `dtype`,
`layers`, `kv_heads`, `head_dim`) and its prices per million tokens (`price_input_per_million`,
`price_output_per_million`, default 0), `aliases` (a list of names), `profiles` (a list whose
order is the profile order; each profile uses the Profile model's field
names) and `adapters` (LoRA adapters on it: `name`, `source`, `enabled`,
`rank`, `aliases` and its own prices, absent = the model's). A price is a number or a string of one
(0.15, "0.15"), read as the exact decimal it shows. Values are checked with the models' own validation
(`clean_fields()` and `clean()`, the same as the admin) and names with the one namespace rule of
`catalog.models` (model names, adapter names and their aliases never repeat), judged on the catalog
as it will be after the file is applied.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from functools import partial
from typing import Any

import yaml
from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.db import models as db
from django.db.models.fields.reverse_related import ForeignObjectRel

from catalog.models import PRICE_FIELDS, PROFILE_FIELDS, Adapter, Alias, Model, Profile
from catalog.rules import MODEL_SIZE_FIELDS, adapter_problems, alias_is_own_name, name_taken, size_problems

# The model's fields a file may change besides its size and prices (catalog.as_code compares them one by one).
MODEL_SWITCHES = ("source", "enabled", "continue_streams")
MODEL_KEYS = (
    "name",
    "source",
    "enabled",
    "continue_streams",
    *MODEL_SIZE_FIELDS,
    *PRICE_FIELDS,
    "aliases",
    "profiles",
    "adapters",
)
ADAPTER_KEYS = ("name", "source", "enabled", "rank", "aliases", *PRICE_FIELDS)
REQUIRED_MODEL_KEYS = ("name", "source", "profiles")
NOT_IN_FILE = {
    "id": "ids are not part of the file; models are matched by name, profiles by position",
    "order": "a profile's order is its position in the list",
    "start_seconds": "the start time is learned, not set",
    "created_at": "timestamps are not part of the file",
    "updated_at": "timestamps are not part of the file",
}


class CatalogFileError(Exception):
    """A catalog file that cannot be applied; `messages` names every problem found (model, field, problem)."""

    def __init__(self, messages: list[str]):
        self.messages = list(messages)
        super().__init__("\n".join(self.messages))


@dataclass
class WantedModel:
    """One model as the file asks for it, its values already validated."""

    position: int
    name: str
    source: str
    enabled: bool
    aliases: list[str] = field(default_factory=list)
    profiles: list[dict[str, Any]] = field(default_factory=list)
    size: dict[str, Any] = field(default_factory=dict)  # MODEL_SIZE_FIELDS, each None/"" when not given
    adapters: list[dict[str, Any]] = field(default_factory=list)  # ADAPTER_KEYS, validated
    continue_streams: bool = True
    prices: dict[str, Decimal] = field(default_factory=dict)  # PRICE_FIELDS, 0 when not given

    def own_fields(self) -> dict[str, Any]:
        """The model's own fields besides its name, source and `enabled`: its size, prices and switches."""
        return {**self.size, **self.prices, "continue_streams": self.continue_streams}

    @property
    def label(self) -> str:
        return f'models[{self.position}] "{self.name}"'


def load_catalog_text(text: str) -> Any:
    """Parse YAML text (safe loader only), or raise CatalogFileError naming where it is not YAML."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise CatalogFileError([f"the file is not valid YAML: {' '.join(str(exc).split())}"]) from None


def read_models(data: Any, problems: list[str]) -> list[WantedModel]:
    """The models of a parsed file; what is wrong is appended to `problems`.

    A model with problems is still returned when it has a name, so that its
    names are checked too; apply nothing while `problems` is not empty.
    """
    if data is None:
        problems.append("the file is empty; expected a mapping with a `models:` list")
        return []
    if not isinstance(data, dict):
        problems.append(f"the top level must be a mapping with a `models:` list, not {_kind(data)}")
        return []
    for key in data:
        if key != "models":
            problems.append(f"unknown top-level key {key!r} (expected only `models:`)")
    if "models" not in data:
        problems.append("the top level has no `models:` list")
        return []
    if not isinstance(data["models"], list):
        problems.append(f"models: expected a list of models, got {_kind(data['models'])}")
        return []
    wanted = []
    for position, entry in enumerate(data["models"]):
        model = _read_model(position, entry, problems)
        if model is not None:
            wanted.append(model)
    return wanted


# A model or adapter's name with its aliases, as the catalog keeps it.
NamedRow = tuple[str, list[str]]


def check_names(
    wanted: list[WantedModel], kept: Iterable[tuple[NamedRow, list[NamedRow]]], problems: list[str]
) -> None:
    """Model names, adapter names and their aliases share one namespace, inside the file and with the models
    it keeps.

    `kept`: ((name, aliases), [(adapter name, aliases), …]) of the models that
    stay in the catalog untouched by the file. Names of models the file lists
    are judged on the file's values, so an alias may move from one listed model
    to another in one apply.
    """
    owners: dict[str, tuple[str, bool, str, str]] = {}  # name -> (owner, is an alias, where, model|adapter)
    for (name, aliases), adapters in kept:
        for kind, (owner, names) in [("model", (name, aliases)), *(("adapter", row) for row in adapters)]:
            owners[owner] = (owner, False, "", kind)
            for alias in names:
                owners[alias] = (owner, True, "", kind)

    def claim(name: str, owner: str, as_alias: bool, where: str, kind: str = "model") -> str | None:
        if name in owners:
            other, other_is_alias, other_where, other_kind = owners[name]
            taken = name_taken(name, owner=other, as_alias=other_is_alias, kind=other_kind)
            return taken + (f" ({other_where})" if other_where else "")
        owners[name] = (owner, as_alias, where, kind)
        return None

    for model in wanted:
        clash = claim(model.name, model.name, False, model.label)
        if clash:
            problems.append(f"{model.label}: name: {clash}")
        for i, alias in enumerate(model.aliases):
            clash = (
                alias_is_own_name(alias)
                if alias == model.name
                else claim(alias, model.name, True, f"{model.label}: aliases[{i}]")
            )
            if clash:
                problems.append(f"{model.label}: aliases[{i}]: {clash}")
        for j, adapter in enumerate(model.adapters):
            where = f"{model.label}: adapters[{j}]"
            adapter_names: list[tuple[str, Any]] = [("name", adapter["name"])] + [
                (f"aliases[{i}]", a) for i, a in enumerate(adapter["aliases"])
            ]
            for key, name in adapter_names:
                # An alias equal to its own adapter's name was named when the adapter was read.
                if key == "name" or name != adapter["name"]:
                    clash = claim(name, adapter["name"], key != "name", f"{where}.{key}", "adapter")
                    if clash:
                        problems.append(f"{where}.{key}: {clash}")


def _read_model(position: int, entry: Any, problems: list[str]) -> WantedModel | None:
    if not isinstance(entry, dict):
        problems.append(f"models[{position}]: expected a mapping with {', '.join(MODEL_KEYS)}, got {_kind(entry)}")
        return None
    name = entry.get("name")
    label = f'models[{position}] "{name}"' if isinstance(name, str) else f"models[{position}]"
    _unknown_keys(entry, MODEL_KEYS, label, problems)
    for key in REQUIRED_MODEL_KEYS:
        if key not in entry:
            problems.append(f"{label}: {key}: missing (required)")
    own_keys = ("name", "source", "enabled", "continue_streams", *MODEL_SIZE_FIELDS, *PRICE_FIELDS)
    values = {key: entry[key] for key in own_keys if key in entry}
    at = _located(label, ": ")
    bad = _type_problems(Model, values, at, problems) | {key for key in REQUIRED_MODEL_KEYS if key not in entry}
    _exact_prices(values, bad)
    instance = Model(**{k: v for k, v in values.items() if k not in bad})
    # Name clashes are judged for the whole file (check_names), not row by row
    # against the database as Model.clean() does; the rest is the fields' own validation.
    _collect(lambda: instance.clean_fields(exclude=[*bad, "created_at", "updated_at"]), at, problems)
    if not bad:
        problems.extend(f"{label}: {name}: {problem}" for name, problem in size_problems(instance).items())

    aliases = _read_aliases(entry.get("aliases", []), label, problems)
    profiles_data = entry.get("profiles", [])
    profiles = []
    if not isinstance(profiles_data, list):
        problems.append(f"{label}: profiles: expected a list of profiles, got {_kind(profiles_data)}")
    else:
        for i, profile in enumerate(profiles_data):
            profiles.append(_read_profile(profile, f"{label}: profiles[{i}]", problems))
    adapters = _read_adapters(entry.get("adapters", []), label, str(name), profiles, problems)
    if not isinstance(name, str):
        return None
    # Returned even with problems (the caller raises), so its names are checked against the rest.
    size = {name: getattr(instance, name) for name in MODEL_SIZE_FIELDS}
    wanted = WantedModel(position, instance.name, instance.source, instance.enabled, aliases, profiles, size, adapters)
    wanted.continue_streams = instance.continue_streams
    wanted.prices = {name: getattr(instance, name) for name in PRICE_FIELDS}
    return wanted


def _read_adapters(
    entries: Any, label: str, model_name: str, profiles: list[dict[str, Any]], problems: list[str]
) -> list[dict[str, Any]]:
    """The model's adapters as the file gives them (every key filled in), judged against the file's profiles."""
    if not isinstance(entries, list):
        problems.append(f"{label}: adapters: expected a list of adapters, got {_kind(entries)}")
        return []
    slots = [(p.get("max_adapters"), p.get("max_adapter_rank")) for p in profiles]
    adapters = []
    for i, entry in enumerate(entries):
        where = f"{label}: adapters[{i}]"
        if not isinstance(entry, dict):
            problems.append(f"{where}: expected a mapping with {', '.join(ADAPTER_KEYS)}, got {_kind(entry)}")
            continue
        _unknown_keys(entry, ADAPTER_KEYS, where, problems)
        missing = {key for key in ("name", "source") if key not in entry}
        problems.extend(f"{where}.{key}: missing (required)" for key in sorted(missing))
        values = {key: entry[key] for key in ADAPTER_KEYS if key in entry}
        at = _located(where, ".")
        bad = _type_problems(Adapter, values, at, problems) | missing
        _exact_prices(values, bad)
        adapter = Adapter(**{k: v for k, v in values.items() if k not in bad})
        _collect(partial(adapter.clean_fields, exclude=[*bad, "base", "created_at", "updated_at"]), at, problems)
        if not bad:
            found = adapter_problems(adapter.known_rank, model_name, slots, adapter.aliases, adapter.name)
            problems.extend(f"{at(key)}: {problem}" for key, problem in found.items())
            if "aliases" not in found:
                for j, alias in enumerate(adapter.aliases):
                    alias_row = Alias(name=alias)
                    _collect(
                        partial(alias_row.clean_fields, exclude=["model"]), _fixed(f"{where}.aliases[{j}]"), problems
                    )
        names = [adapter.name, *adapter.aliases] if isinstance(adapter.aliases, list) else [None]
        if all(isinstance(name, str) and name for name in names):  # named ones only are checked against the rest
            adapters.append({key: getattr(adapter, key) for key in ADAPTER_KEYS})
    return adapters


def _read_aliases(aliases: Any, label: str, problems: list[str]) -> list[str]:
    if not isinstance(aliases, list):
        problems.append(f"{label}: aliases: expected a list of names, got {_kind(aliases)}")
        return []
    names = []
    for i, name in enumerate(aliases):
        if not isinstance(name, str):
            problems.append(f"{label}: aliases[{i}]: expected a name (a string), got {_kind(name)}")
            continue
        alias = Alias(name=name)
        _collect(partial(alias.clean_fields, exclude=["model"]), _fixed(f"{label}: aliases[{i}]"), problems)
        names.append(name)
    return names


def _read_profile(entry: Any, label: str, problems: list[str]) -> dict[str, Any]:
    if not isinstance(entry, dict):
        problems.append(f"{label}: expected a mapping of profile fields, got {_kind(entry)}")
        return {}
    _unknown_keys(entry, PROFILE_FIELDS, label, problems)
    values = {key: entry[key] for key in PROFILE_FIELDS if key in entry}
    missing = {name for name in PROFILE_FIELDS if name not in entry and not _optional(Profile._meta.get_field(name))}
    problems.extend(f"{label}.{name}: missing (required)" for name in sorted(missing))
    at = _located(label, ".")
    bad = _type_problems(Profile, values, at, problems) | missing
    profile = Profile(**{k: v for k, v in values.items() if k not in bad})
    if bad:
        # clean() compares fields with each other; with one of them unreadable it would mislead.
        _collect(lambda: profile.clean_fields(exclude=[*bad, "model"]), at, problems)
    else:
        # Every check constraint repeats a field validator or clean(), and validating
        # one costs a query each, so the constraints are left to the database.
        _collect(
            lambda: profile.full_clean(exclude=["model"], validate_unique=False, validate_constraints=False),
            at,
            problems,
        )
    return {name: getattr(profile, name) for name in PROFILE_FIELDS}


def _unknown_keys(entry: dict, known: Iterable[str], label: str, problems: list[str]) -> None:
    known = tuple(known)
    for key in entry:
        if key in known:
            continue
        why = NOT_IN_FILE.get(key) or f"expected one of {', '.join(known)}"
        problems.append(f"{label}: unknown key {key!r} ({why})")


def _type_problems(
    model: type[db.Model], values: dict[str, Any], at: Callable[[str], str], problems: list[str]
) -> set[str]:
    """Names of the fields whose value has the wrong type (a YAML string where a number belongs is a
    mistake to name, not a value to convert)."""
    bad = set()
    for name, value in values.items():
        model_field = model._meta.get_field(name)
        if value is None:
            if not model_field.null:
                problems.append(f"{at(name)}: empty; give a value or leave the key out for the default")
                bad.add(name)
            continue
        expected = _expected_type(model_field)
        if expected is not None and not _is(value, expected):
            problems.append(f"{at(name)}: expected {_KINDS[expected]}, got {_kind(value)}")
            bad.add(name)
    return bad


def _exact_prices(values: dict[str, Any], bad: set[str]) -> None:
    """Turn the prices read into Decimals: a YAML number by its shortest text (0.15, not the binary double
    nearest it; a price has at most 14 digits, which a double gives back exactly), a string as written."""
    for name in PRICE_FIELDS:
        if name in values and name not in bad and values[name] is not None:
            values[name] = _decimal(values[name])


def _decimal(value: Any) -> Decimal | None:
    """The finite Decimal a number or numeric string shows, else None (booleans are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, int | float | str | Decimal):
        return None
    try:
        number = Decimal(repr(value) if isinstance(value, float) else value)
    except InvalidOperation:
        return None
    return number if number.is_finite() else None


def _expected_type(model_field) -> type | None:
    if isinstance(model_field, db.DecimalField):
        return Decimal
    if isinstance(model_field, db.BooleanField):
        return bool
    if isinstance(model_field, db.IntegerField):
        return int
    if isinstance(model_field, db.CharField):
        return str
    if isinstance(model_field, db.FloatField):
        return float
    return None  # JSON fields: their clean() says what they accept


def _is(value: Any, expected: type) -> bool:
    # YAML true/false are bools, and bool is a subclass of int: neither is a number here. An integer is a float.
    if expected is Decimal:
        return _decimal(value) is not None
    if isinstance(value, bool):
        return expected is bool
    return isinstance(value, int | float) if expected is float else isinstance(value, expected)


def _located(label: str, separator: str) -> Callable[[str], str]:
    """Where a field's problem is: `label`, then the field (errors of the whole row: `label` alone)."""
    return lambda name: label if name == NON_FIELD_ERRORS else f"{label}{separator}{name}"


def _fixed(label: str) -> Callable[[str], str]:
    return lambda name: label


def _collect(validate: Callable[[], None], at: Callable[[str], str], problems: list[str]) -> None:
    """Run one of the models' own validations and turn its errors into located messages."""
    try:
        validate()
    except ValidationError as exc:
        for name, messages in exc.message_dict.items():
            problems.extend(f"{at(name)}: {message}" for message in messages)


_KINDS: dict[type, str] = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    Decimal: 'a number such as 0.15 (or a string of one, "0.15")',
    str: "a string",
    list: "a list",
    dict: "a mapping",
}


def _kind(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return f"{str(value).lower()} (true/false)"
    if isinstance(value, str):
        return f"a string ({value!r})"
    if isinstance(value, int | float):
        return f"a number ({value!r})"
    return _KINDS.get(type(value), type(value).__name__)


def _optional(field: db.Field[Any, Any] | ForeignObjectRel) -> bool:
    """Whether a profile field may be left out of a catalog file: it has a default or takes NULL."""
    return isinstance(field, db.Field) and (field.has_default() or field.null)
