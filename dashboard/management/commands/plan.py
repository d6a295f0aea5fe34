"""`manage.py plan --file FILE [--json]` and `manage.py plan MODEL [MODEL...] [--json]`: will it fit?
`manage.py plan MODEL [MODEL...] --load FACTOR [--json]`: how many replicas would this load need?

Thin over reconciler.planner.what_if: per model, fits (where), fits after stopping
(which replicas, what each frees) or does not fit (why, per profile), planned
in order and cumulatively; with --load, over reconciler.planner.load: the replicas each
model would need at FACTOR times the load the routers see now. Writes nothing.
"""

import argparse
import json
import sys
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from catalog.catalog_file import CatalogFileError, load_catalog_text
from reconciler.planner.answer import Verdict
from reconciler.planner.load import replicas_for_load
from reconciler.planner.what_if import PlanInputError, entries_from_names, plan_request


def _factor(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"the load factor must be a number (2 for twice today's), got {text!r}"
        ) from None
    if not 0 < value <= 1000:
        raise argparse.ArgumentTypeError(f"the load factor must be above 0 and at most 1000, got {text}")
    return value


class Command(BaseCommand):
    """Read the file or the names, plan, print one block per model (or the JSON answer)."""

    help = "Would these models fit the fleet now, where, and what would have to stop? Changes nothing."

    def add_arguments(self, parser):
        parser.add_argument("models", nargs="*", metavar="MODEL", help="Catalog models (names or aliases) to plan.")
        parser.add_argument("--file", help="A catalog-format YAML file (- for stdin) whose models are planned first.")
        parser.add_argument("--json", action="store_true", help='Print {"models": [...]} as JSON.')
        parser.add_argument(
            "--load",
            type=_factor,
            metavar="FACTOR",
            help="Instead: how many replicas each model would need at FACTOR times the load the routers see now "
            "(1: today's), from its latency objectives, else its target concurrency.",
        )

    def handle(self, *args, models, file, **options):
        if not models and not file:
            raise CommandError("give a catalog file (--file FILE) or catalog model names to plan")
        if options["load"] is not None:
            return self._load(models, file, options["load"], options["json"])
        data = self._read(file) if file else None
        try:
            answer = plan_request(data, models)
        except PlanInputError as exc:
            count = len(exc.messages)
            listing = "\n".join(f"  {m}" for m in exc.messages)
            raise CommandError(f"{count} problem{'s' if count != 1 else ''}, nothing planned:\n{listing}") from None
        if options["json"]:
            self.stdout.write(json.dumps(answer.to_json(), indent=2))
            return
        styles = {Verdict.FITS: self.style.SUCCESS, Verdict.FITS_AFTER_STOPPING: self.style.WARNING}
        for i, model in enumerate(answer.models):
            if i:
                self.stdout.write("")
            lines = model.lines()
            self.stdout.write(styles.get(model.verdict, self.style.ERROR)(lines[0]))
            for line in lines[1:]:
                self.stdout.write(line)
        if not answer.usage_known and any(m.verdict is not Verdict.FITS for m in answer.models):
            self.stdout.write(f"\nnothing counts as idle, so nothing would be stopped: {answer.usage_reason}")

    def _load(self, models: list[str], file: str | None, factor: float, as_json: bool) -> None:
        if file or not models:
            raise CommandError("--load plans catalog models by name, not a file: name the models")
        try:
            names = [entry.name for entry in entries_from_names(models)]
        except PlanInputError as exc:
            raise CommandError("; ".join(exc.messages)) from None
        answers = replicas_for_load(names, factor, timezone.now())
        if as_json:
            self.stdout.write(json.dumps({"load": [answer.to_json() for answer in answers]}, indent=2))
            return
        for answer in answers:
            self.stdout.write(answer.line())

    def _read(self, file: str):
        try:
            text = sys.stdin.read() if file == "-" else Path(file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CommandError(f"cannot read {file}: {getattr(exc, 'strerror', None) or exc}") from None
        try:
            return load_catalog_text(text)
        except CatalogFileError as exc:
            raise CommandError(f"{file}: {exc.messages[0]}") from None
