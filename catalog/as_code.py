"""Catalog as code: export the catalog as a file's data, and apply one — planned first, then all or nothing.

Models are matched by name, profiles by position, adapters by name: an existing profile row is
updated in place, so it keeps its id, its learned start time and the replicas
on it; rows beyond the file's list are deleted, and their replicas go with
them by cascade (agents then stop the orphaned engines). Applying the same
file twice changes nothing the second time. Secret engine env values are
exported as the mask (nodewire/engine_env.py), and a mask applied keeps the
stored value (`catalog.rules.keep_stored_secrets`). Prices are exported as the
plain numbers they are (0.15) and read back exactly (`catalog.catalog_file`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import yaml
from django.db import transaction
from django.db.models import Count, Prefetch

from catalog.catalog_file import (
    ADAPTER_KEYS,
    MODEL_SWITCHES,
    CatalogFileError,
    WantedModel,
    check_names,
    read_models,
)
from catalog.models import PRICE_FIELDS, PROFILE_FIELDS, Adapter, Alias, Model, Profile
from catalog.prices import price_text
from catalog.rules import MODEL_SIZE_FIELDS, keep_stored_secrets
from catalog.sizing import fit_warnings, fleet_memory, verdict_lines
from nodewire.engine_env import masked

__all__ = ["CatalogFileError", "ModelPlan", "Plan", "Verdict", "apply_catalog", "dump_catalog", "export_catalog"]


class Verdict(enum.StrEnum):
    """What applying the file does to one model."""

    CREATED = "created"
    CHANGED = "changed"
    LEFT_ALONE = "left alone"
    DELETED = "deleted"
    NOT_IN_FILE = "not in file"


@dataclass
class ModelPlan:
    """One model's part of a plan: its verdict, what changes, and the rows to write."""

    name: str
    verdict: Verdict
    details: list[str] = field(default_factory=list)
    wanted: WantedModel | None = None
    existing: Model | None = None
    model_fields: list[str] = field(default_factory=list)
    aliases_added: list[str] = field(default_factory=list)
    aliases_removed: list[Alias] = field(default_factory=list)
    profiles_updated: list[tuple[Profile, list[str], dict[str, Any]]] = field(default_factory=list)
    profiles_added: list[tuple[int, dict[str, Any]]] = field(default_factory=list)  # (order, fields)
    profiles_deleted: list[Profile] = field(default_factory=list)
    adapters_added: list[dict[str, Any]] = field(default_factory=list)
    adapters_updated: list[tuple[Adapter, list[str], dict[str, Any]]] = field(default_factory=list)
    adapters_deleted: list[Adapter] = field(default_factory=list)

    def line(self) -> str:
        text = f"{self.verdict.value:<11}  {self.name}"
        return f"{text}: {'; '.join(self.details)}" if self.details else text


@dataclass
class Plan:
    """What applying a catalog file does (or did), model by model, in file order then the rest by name."""

    models: list[ModelPlan]
    prune: bool
    dry_run: bool = False

    def count(self, verdict: Verdict) -> int:
        return sum(1 for m in self.models if m.verdict == verdict)

    def lines(self) -> list[str]:
        summary = ", ".join(f"{self.count(v)} {v.value}" for v in Verdict if v != Verdict.NOT_IN_FILE)
        if self.count(Verdict.NOT_IN_FILE):
            summary += f", {self.count(Verdict.NOT_IN_FILE)} not in file (kept; --prune deletes)"
        last = f"dry run, nothing changed: {summary}" if self.dry_run else summary
        return [m.line() for m in self.models] + [last]


def wanted_profiles(part: ModelPlan) -> list[Profile]:
    """The profiles the file gives a model, as unsaved rows (for the memory verdicts of catalog.sizing)."""
    wanted = part.wanted
    if wanted is None:
        return []
    model = Model(name=wanted.name, source=wanted.source, enabled=wanted.enabled, **wanted.own_fields())
    return [Profile(model=model, order=i, **fields) for i, fields in enumerate(wanted.profiles) if fields]


def fit_report(plan: Plan) -> tuple[list[str], list[str]]:
    """(warnings, verdicts) for the models a plan writes: a warning per profile placement will refuse for its
    memory, and every profile's verdict (fits, does not fit, size unknown) for a dry run. One query."""
    fleet = fleet_memory()
    warnings, verdicts = [], []
    for part in plan.models:
        profiles = wanted_profiles(part)
        warnings += [f"{part.name}: {w}" for w in fit_warnings(profiles, fleet)]
        verdicts += [f"{part.name}: {line}" for _, line in verdict_lines(profiles, fleet)]
    return warnings, verdicts


def export_catalog() -> dict[str, Any]:
    """The whole catalog as a file's data: `models:`, each with its aliases, profiles in order and adapters."""
    models = Model.objects.prefetch_related("aliases", "profiles", "adapters")
    return {
        "models": [
            {
                "name": model.name,
                "source": model.source,
                "enabled": model.enabled,
                # Only when off, so a file without it reads as before.
                **({} if model.continue_streams else {"continue_streams": False}),
                # Size fields only when given, so a file without them reads as before.
                **{name: getattr(model, name) for name in MODEL_SIZE_FIELDS if getattr(model, name) not in (None, "")},
                # Prices only when not free, so a file without them reads as before.
                **{name: getattr(model, name) for name in PRICE_FIELDS if getattr(model, name)},
                "aliases": [alias.name for alias in model.aliases.all()],
                "profiles": [_exported_profile(p) for p in model.profiles.all()],
                # Only when it has some, so a file without adapters reads as before.
                **({"adapters": adapters} if (adapters := _exported_adapters(model)) else {}),
            }
            for model in models
        ]
    }


def _exported_profile(profile: Profile) -> dict[str, Any]:
    # Secret values stay out of the file (it is meant for version control); applying the mask keeps them.
    # Variables by name: PostgreSQL's jsonb keeps its own key order, and the file reads the same on any database.
    env = dict(sorted(masked(profile.env).items()))
    return {name: env if name == "env" else getattr(profile, name) for name in PROFILE_FIELDS}


def _exported_adapters(model: Model) -> list[dict[str, Any]]:
    # An adapter's prices only when it sets them: absent, it costs what its model costs.
    return [
        {
            name: getattr(adapter, name)
            for name in ADAPTER_KEYS
            if name not in PRICE_FIELDS or getattr(adapter, name) is not None
        }
        for adapter in model.adapters.all()
    ]


class _CatalogDumper(yaml.SafeDumper):
    """YAML's safe dumper, writing a price (a Decimal) as the plain number it shows: 0.15, 100."""

    def represent_price(self, price: Decimal) -> yaml.ScalarNode:
        text = price_text(price)
        # Tagged as the reader resolves the text (int or float), so it is written bare, not as `!!float 100`.
        return self.represent_scalar(self.resolve(yaml.ScalarNode, text, (True, False)), text)


_CatalogDumper.add_representer(Decimal, _CatalogDumper.represent_price)


def dump_catalog(data: dict[str, Any]) -> str:
    """YAML text for a file's data (lists of plain values, such as aliases and engine args, on one line)."""
    return yaml.dump(
        data, Dumper=_CatalogDumper, sort_keys=False, allow_unicode=True, default_flow_style=None, width=120
    )


def plan_catalog(data: Any, *, prune: bool = False) -> Plan:
    """Validate a parsed catalog file against the catalog and say what applying it would do.

    Raises CatalogFileError listing every problem; reads a constant number of queries.
    """
    problems: list[str] = []
    wanted = read_models(data, problems)
    if problems and not wanted:
        raise CatalogFileError(problems)  # no model to compare with the catalog
    listed = {m.name for m in wanted}
    profiles = Profile.objects.annotate(replica_count=Count("replicas")).order_by("order", "id")
    existing = {
        m.name: m
        for m in Model.objects.prefetch_related("aliases", "adapters", Prefetch("profiles", queryset=profiles))
    }
    unlisted = [m for name, m in sorted(existing.items()) if name not in listed]
    kept = [] if prune else [_names(m) for m in unlisted]
    check_names(wanted, kept, problems)
    _keep_stored_secrets(wanted, existing, problems)
    if problems:
        raise CatalogFileError(problems)
    plans = [_plan_model(w, existing.get(w.name)) for w in wanted]
    for model in unlisted:
        if prune:
            rows = list(model.profiles.all())
            replicas = sum(p.replica_count for p in rows)  # type: ignore[attr-defined]  # annotated by the query above
            gone = f"{_count(len(rows), 'profile')}, {_count(replicas, 'replica')} go with it"
            plans.append(ModelPlan(model.name, Verdict.DELETED, [gone], existing=model))
        else:
            plans.append(ModelPlan(model.name, Verdict.NOT_IN_FILE, ["kept; --prune deletes"], existing=model))
    return Plan(plans, prune)


def _names(model: Model) -> tuple[tuple[str, list[str]], list[tuple[str, list[str]]]]:
    """A kept model's public names for check_names: its own with its aliases, and its adapters' with theirs."""
    return (model.name, [a.name for a in model.aliases.all()]), [
        (a.name, list(a.aliases)) for a in model.adapters.all()
    ]


def apply_catalog(data: Any, *, prune: bool = False, dry_run: bool = False) -> Plan:
    """Make the catalog what the parsed file says, in one transaction; with `dry_run`, only plan.

    With `prune`, models not in the file are deleted; without it they stay.
    Raises CatalogFileError (nothing changed) when the file has any problem.
    """
    with transaction.atomic():
        plan = plan_catalog(data, prune=prune)
        plan.dry_run = dry_run
        if not dry_run:
            _carry_out(plan)
    return plan


def _keep_stored_secrets(wanted: list[WantedModel], existing: dict[str, Model], problems: list[str]) -> None:
    """Put back the stored value of each secret the file shows as the mask (as `export` writes it).

    The model's profiles are looked up as `keep_stored_secrets` says (the value
    they agree on, else the profile at the same position); a mask with nothing
    stored behind it is a problem naming the variable.
    """
    for model in wanted:
        current = existing.get(model.name)
        rows = list(current.profiles.all()) if current is not None else []
        for i, fields in enumerate(model.profiles):
            if "env" not in fields:
                continue  # an entry that was not a mapping, already named
            stored = rows[i].env if i < len(rows) else {}
            siblings = [row.env for j, row in enumerate(rows) if j != i]
            fields["env"], problem = keep_stored_secrets(fields["env"], stored, siblings)
            if problem is not None:
                problems.append(f"{model.label}: profiles[{i}].env: {problem}")


def _plan_model(wanted: WantedModel, model: Model | None) -> ModelPlan:
    if model is None:
        plan = ModelPlan(wanted.name, Verdict.CREATED, wanted=wanted)
        plan.aliases_added = list(wanted.aliases)
        plan.profiles_added = list(enumerate(wanted.profiles))
        if wanted.aliases:
            plan.details.append(f"aliases {', '.join(wanted.aliases)}")
        plan.details.append(_count(len(wanted.profiles), "profile"))
        plan.adapters_added = list(wanted.adapters)
        if wanted.adapters:
            plan.details.append(f"adapters {', '.join(a['name'] for a in wanted.adapters)}")
        return plan
    plan = ModelPlan(wanted.name, Verdict.LEFT_ALONE, wanted=wanted, existing=model)
    plan.model_fields = [f for f in MODEL_SWITCHES if getattr(model, f) != getattr(wanted, f)]
    plan.model_fields += [f for f in MODEL_SIZE_FIELDS if getattr(model, f) != wanted.size[f]]
    plan.model_fields += [f for f in PRICE_FIELDS if getattr(model, f) != wanted.prices[f]]
    if plan.model_fields:
        plan.details.append(", ".join(plan.model_fields))

    aliases = {a.name: a for a in model.aliases.all()}
    plan.aliases_added = [a for a in wanted.aliases if a not in aliases]
    plan.aliases_removed = [a for name, a in aliases.items() if name not in wanted.aliases]
    if plan.aliases_added or plan.aliases_removed:
        moves = [f"+{a}" for a in plan.aliases_added] + [f"-{a.name}" for a in plan.aliases_removed]
        plan.details.append(f"aliases {' '.join(moves)}")

    rows = list(model.profiles.all())
    order = -1
    for i, fields in enumerate(wanted.profiles):
        if i < len(rows):
            row = rows[i]
            order = row.order
            changed = [name for name in PROFILE_FIELDS if getattr(row, name) != fields[name]]
            if changed:
                plan.profiles_updated.append((row, changed, fields))
                plan.details.append(f"profiles[{i}] {', '.join(changed)}")
        else:
            # Existing rows keep their order values; a new one sorts after them (ties go by id).
            order = max(i, order)
            plan.profiles_added.append((order, fields))
            plan.details.append(f"profiles[{i}] added")
    for i, row in enumerate(rows[len(wanted.profiles) :], start=len(wanted.profiles)):
        plan.profiles_deleted.append(row)
        replicas = row.replica_count  # type: ignore[attr-defined]  # annotated by the profiles' query
        plan.details.append(f"profiles[{i}] deleted ({_count(replicas, 'replica')} with it)")
    _plan_adapters(plan, wanted, model)
    if plan.details:
        plan.verdict = Verdict.CHANGED
    return plan


def _plan_adapters(plan: ModelPlan, wanted: WantedModel, model: Model) -> None:
    """Adapters by name: the file's new ones added, changed ones updated in place, unlisted ones deleted."""
    rows = {a.name: a for a in model.adapters.all()}
    listed = {a["name"] for a in wanted.adapters}
    moves = []
    for fields in wanted.adapters:
        row = rows.get(fields["name"])
        if row is None:
            plan.adapters_added.append(fields)
            moves.append(f"+{fields['name']}")
            continue
        changed = [name for name in ADAPTER_KEYS if getattr(row, name) != fields[name]]
        if changed:
            plan.adapters_updated.append((row, changed, fields))
            moves.append(f"~{row.name} ({', '.join(changed)})")
    plan.adapters_deleted = [row for name, row in rows.items() if name not in listed]
    moves += [f"-{row.name}" for row in plan.adapters_deleted]
    if moves:
        plan.details.append(f"adapters {' '.join(moves)}")


def _carry_out(plan: Plan) -> None:
    """Write the plan. Deletes go first, so a name a deleted row held can be taken in the same apply.

    Rows are saved one by one (queries grow with rows written, not with fields),
    so the catalog's save signals publish the change to the routers on commit.
    """
    doomed = [m.existing.pk for m in plan.models if m.verdict == Verdict.DELETED and m.existing]
    if doomed:
        Model.objects.filter(pk__in=doomed).delete()
    aliases = [a.pk for m in plan.models for a in m.aliases_removed]
    if aliases:
        Alias.objects.filter(pk__in=aliases).delete()
    profiles = [p.pk for m in plan.models for p in m.profiles_deleted]
    if profiles:
        Profile.objects.filter(pk__in=profiles).delete()
    adapters = [a.pk for m in plan.models for a in m.adapters_deleted]
    if adapters:
        Adapter.objects.filter(pk__in=adapters).delete()
    for part in plan.models:
        wanted = part.wanted
        if wanted is None or part.verdict == Verdict.LEFT_ALONE:
            continue
        model = part.existing
        if model is None:
            model = Model(name=wanted.name, source=wanted.source, enabled=wanted.enabled, **wanted.own_fields())
            model.save()
        elif part.model_fields:
            own = wanted.own_fields()
            for name in part.model_fields:
                setattr(model, name, own[name] if name in own else getattr(wanted, name))
            model.save(update_fields=[*part.model_fields, "updated_at"])
        for name in part.aliases_added:
            Alias(model=model, name=name).save()
        for row, changed, fields in part.profiles_updated:
            for name in changed:
                setattr(row, name, fields[name])
            row.save(update_fields=changed)
        for order, fields in part.profiles_added:
            Profile(model=model, order=order, **fields).save()
        for adapter, changed, fields in part.adapters_updated:
            for name in changed:
                setattr(adapter, name, fields[name])
            adapter.save(update_fields=[*changed, "updated_at"])
        for fields in part.adapters_added:
            Adapter(base=model, **fields).save()


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
