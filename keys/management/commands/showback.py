"""`manage.py showback [--month YYYY-MM] [--by-model] [--csv]`: each team's share of the GPU-hours of a UTC month.

Thin over keys.showback: a table of teams (keys of no team and idle time on lines of their own), or CSV rows of
team, model, GPU-hours and tokens for a chargeback sheet. Writes nothing.
"""

import csv
from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from keys.showback import Showback, gpu_hours, month_bounds, showback

NO_TEAM, IDLE = "(no team)", "(idle)"


class Command(BaseCommand):
    """Read the month, divide its GPU time, print the table or the CSV."""

    help = "Each team's share of the GPU-hours of a month (UTC), by its share of each replica's tokens."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--month", help="The month, YYYY-MM (UTC); default: this month, so far.")
        parser.add_argument("--by-model", action="store_true", help="A line per team and model.")
        parser.add_argument("--csv", action="store_true", help="CSV: team, model, gpu_hours, tokens.")

    def handle(self, *args: Any, month: str | None, by_model: bool, **options: Any) -> None:
        try:
            start, end = month_bounds(month, timezone.now())
        except ValueError as exc:
            raise CommandError(f"--month {exc}") from None
        report = showback(start, end)
        if options["csv"]:
            self._csv(report)
        else:
            self._table(report, by_model)

    def _csv(self, report: Showback) -> None:
        out = csv.writer(self.stdout, lineterminator="\n")
        out.writerow(["team", "model", "gpu_hours", "tokens"])
        for row in report.rows:
            out.writerow([row.team or NO_TEAM, row.model, f"{row.gpu_seconds / 3600:.6f}", row.tokens])
        for model, seconds in report.idle.items():
            out.writerow([IDLE, model, f"{seconds / 3600:.6f}", 0])

    def _table(self, report: Showback, by_model: bool) -> None:
        total = report.total_seconds
        self.stdout.write(f"Showback {report.start:%Y-%m} (UTC): {gpu_hours(total)} GPU-hours")
        if not total:
            self.stdout.write("  no GPU time counted in this month")
            return
        lines: list[tuple[str, str, float]] = []
        if by_model:
            lines += [(row.team or NO_TEAM, row.model, row.gpu_seconds) for row in report.rows]
            lines += [(IDLE, model, seconds) for model, seconds in report.idle.items()]
        else:
            lines += [(team or NO_TEAM, "", seconds) for team, seconds in report.by_team().items()]
            lines.append((IDLE, "", sum(report.idle.values())))
        width = max(len(team) for team, _, _ in lines)
        model_width = max(len(model) for _, model, _ in lines)
        for team, model, seconds in lines:
            label = f"{team:<{width}}  {model:<{model_width}}" if by_model else f"{team:<{width}}"
            self.stdout.write(f"  {label}  {gpu_hours(seconds):>10}  {100 * seconds / total:5.1f}%")
