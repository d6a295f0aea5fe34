"""`manage.py catalog export [FILE]` and `manage.py catalog apply FILE [--dry-run] [--prune]`: the catalog as YAML.

Applying warns of each profile whose memory estimate does not fit its GPUs; a dry run shows every profile's verdict.
"""

import sys
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from catalog.as_code import Verdict, apply_catalog, dump_catalog, export_catalog, fit_report
from catalog.catalog_file import CatalogFileError, load_catalog_text


class Command(BaseCommand):
    """Thin over catalog.as_code: read or write the file, print one line per model."""

    help = "Export the catalog as YAML, or apply a YAML catalog file (all or nothing)."

    def add_arguments(self, parser):
        actions = parser.add_subparsers(dest="action", required=True, metavar="{export,apply}")
        export = actions.add_parser("export", help="Write the whole catalog as YAML.")
        export.add_argument("file", nargs="?", default="-", help="Where to write it (default: stdout, or -).")
        apply = actions.add_parser(
            "apply", help="Make the catalog what FILE says: create, change, leave alone; one line per model."
        )
        apply.add_argument("file", help="The YAML catalog file (- for stdin).")
        apply.add_argument(
            "--dry-run",
            action="store_true",
            help="Validate and print the plan and each profile's memory verdict; change nothing.",
        )
        apply.add_argument("--prune", action="store_true", help="Delete the models the file does not list.")

    def handle(self, *args, action, file, **options):
        if action == "export":
            self._export(file)
        else:
            self._apply(file, dry_run=options["dry_run"], prune=options["prune"])

    def _export(self, file: str) -> None:
        text = dump_catalog(export_catalog())
        if file == "-":
            self.stdout.write(text, ending="")
            return
        try:
            Path(file).write_text(text, encoding="utf-8")
        except OSError as exc:
            raise CommandError(f"cannot write {file}: {exc.strerror}") from None
        self.stderr.write(f"catalog written to {file}")

    def _apply(self, file: str, *, dry_run: bool, prune: bool) -> None:
        try:
            text = sys.stdin.read() if file == "-" else Path(file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CommandError(f"cannot read {file}: {getattr(exc, 'strerror', None) or exc}") from None
        try:
            plan = apply_catalog(load_catalog_text(text), prune=prune, dry_run=dry_run)
        except CatalogFileError as exc:
            count = len(exc.messages)
            listing = "\n".join(f"  {m}" for m in exc.messages)
            raise CommandError(
                f"{file}: {count} problem{'s' if count != 1 else ''}, nothing changed:\n{listing}"
            ) from None
        styles = {
            Verdict.CREATED: self.style.SUCCESS,
            Verdict.CHANGED: self.style.WARNING,
            Verdict.DELETED: self.style.ERROR,
        }
        for part, line in zip(plan.models, plan.lines(), strict=False):
            self.stdout.write(styles.get(part.verdict, str)(line))
        warnings, verdicts = fit_report(plan)
        if dry_run:
            for line in verdicts:
                self.stdout.write(f"memory       {line}")
        self.stdout.write(plan.lines()[-1])
        for warning in warnings:
            # A warning, not a refusal: the estimate may be off; placement refuses where it does not fit.
            self.stderr.write(self.style.WARNING(f"warning: {warning}"))
