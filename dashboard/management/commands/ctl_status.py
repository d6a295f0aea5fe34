"""`manage.py ctl_status [--json]`: the cluster summary for a terminal or a script."""

import json

from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError

from dashboard.summary import cluster_summary
from reconciler.idle import Idle

BAR_WIDTH = 16


def usage_bar(row: dict, width: int = BAR_WIDTH) -> str:
    """`[####!!x---------]`: used `#`, unhealthy `!`, unavailable `x`, free `-`."""
    total = row["total"]
    if not total:
        return "[" + " " * width + "]"
    cells = []
    for state, mark in (("used", "#"), ("unhealthy", "!"), ("unavailable", "x")):
        cells.append(mark * round(row[state] * width / total))
    bar = "".join(cells)[:width]
    return "[" + bar + "-" * (width - len(bar)) + "]"


def table(headers: list[str], rows: list[list]) -> list[str]:
    """Left-aligned columns, two spaces apart; the first line is the header."""
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]


class Command(BaseCommand):
    help = "Show the cluster: capacity, free whole nodes, nodes, replicas, models and idle time."

    def add_arguments(self, parser):
        parser.add_argument("--json", action="store_true", help="Print the summary as JSON (for scripts).")

    def handle(self, *args, **options):
        try:
            summary = cluster_summary()
        except DatabaseError as exc:
            raise CommandError(
                f"cannot read the fleet from the database ({exc}); has `manage.py migrate` run?"
            ) from None
        if options["json"]:
            self.stdout.write(json.dumps(summary, indent=2))
            return
        for line in self.render(summary):
            self.stdout.write(line)

    def section(self, title: str) -> str:
        return "\n" + self.style.MIGRATE_HEADING(title)

    def styled_table(self, headers: list[str], rows: list[list], row_style=str) -> list[str]:
        lines = table(headers, rows)
        return ["  " + self.style.SQL_FIELD(lines[0])] + ["  " + row_style(line) for line in lines[1:]]

    def render(self, s: dict) -> list[str]:
        out = [self.style.SUCCESS(f"llmgw status at {s['generated_at']}")]
        leader = s["leader"]
        if leader is None:
            out.append(self.style.WARNING("leader: none (no lease taken yet)"))
        else:
            expires = leader["expires_in_seconds"]
            when = f"expires in {expires:.1f}s" if expires >= 0 else f"EXPIRED {-expires:.1f}s ago"
            line = f"leader: {leader['owner']} (epoch {leader['epoch']}, lease {when})"
            out.append(line if expires >= 0 else self.style.WARNING(line))

        brake = s["partition_brake"]
        if brake["engaged"]:
            out.append(
                self.style.ERROR(
                    f"partition brake: {brake['silent_nodes']} of {brake['watched_nodes']} nodes are silent; "
                    "none is declared lost and nothing is replaced until they are heard from again "
                    "or an operator declares them lost (admin: nodes)"
                )
            )

        out.append(self.section("GPU capacity"))
        if not s["capacity"]:
            out.append("  no GPUs reported")
        width = max((len(r["gpu_class"]) for r in s["capacity"]), default=0)
        for r in s["capacity"]:
            line = (
                f"  {r['gpu_class'].ljust(width)}  {usage_bar(r)}  {r['used']}/{r['total']} used  {r['free']} free"
                f"  {r['unhealthy']} unhealthy  {r['unavailable']} unavailable"
            )
            out.append(self.style.WARNING(line) if r["unhealthy"] or r["unavailable"] else line)

        out.append(self.section("Free whole nodes"))
        rows = [
            [r["fabric"] or "-", r["gpu_class"], r["whole_free_nodes"], ", ".join(r["nodes"]) or "-"]
            for r in s["free_nodes"]
        ]
        out += self.styled_table(["FABRIC", "GPU CLASS", "FREE", "NODES"], rows) if rows else ["  none"]

        out.append(self.section("Nodes"))
        out.append("  " + "  ".join(f"{k} {v}" for k, v in s["nodes"].items()))
        out.append(self.section("Replicas"))
        out.append("  " + "  ".join(f"{k} {v}" for k, v in s["replicas"].items()))

        out.append(self.section("Models"))
        rows = [[m["name"], "yes" if m["enabled"] else "no", m["wanted"], m["ready"]] for m in s["models"]]
        out += self.styled_table(["MODEL", "ENABLED", "WANTED", "READY"], rows) if rows else ["  none"]

        if s["unplaceable"]:
            out.append(self.section("Unplaceable"))
            rows = [[u["model"], u["pending"], " ".join(u["reason"].split())] for u in s["unplaceable"]]
            out += self.styled_table(["MODEL", "PENDING", "REASON"], rows, row_style=self.style.ERROR)

        out.append(self.section("Replica list"))
        rows = [
            [
                r["id"],
                r["model"],
                r["state"],
                ",".join(r["nodes"]) or "-",
                r["gpus"],
                r["endpoint"] or "-",
                str(Idle.from_json(r["idle_seconds"], r["idle_known"])),
            ]
            for r in s["replica_list"]
        ]
        out += (
            self.styled_table(["ID", "MODEL", "STATE", "NODES", "GPUS", "ENDPOINT", "IDLE"], rows)
            if rows
            else ["  none"]
        )
        return out
