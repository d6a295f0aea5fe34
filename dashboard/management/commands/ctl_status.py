"""`manage.py ctl_status [--json] [--top N] [--all] [--nodes] [--models] [--replicas] [--teams] [--check]
[--watch N]`.

The cluster summary for a terminal or a script. The text fits a screen (SCREEN_LINES) at any fleet size and in
any trouble: free whole nodes show a few names per (fabric, class), models those that need a look and then the
top holders of GPUs, with their replicas counted per state, a base model's LoRA adapters one line of counts,
unplaceable models apart from held ones, failed replicas grouped by reason, answers whose engine broke off in the
last hour per model (the most broken first), what users felt per model over the routers' last window (latency
against its objectives, fair queues, teams' shares), weights being staged on nodes (only when some are, or
ended in the last hour), "what can I stop" the top entries; `--all` prints everything,
`--nodes`, `--models` and `--replicas` just the full node, model or replica list. `--teams` adds each team's
members, keys, spend, GPU-hours and budgets (`dashboard.team_summary`; "team_summary" with --json). `--check`
prints one line and exits 2 when something needs attention (`dashboard.attention.needs_attention`), 0 otherwise:
for cron and monitoring. `--watch N` redraws every N seconds until Ctrl-C.
"""

import json
import os
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import datetime

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError

from dashboard.attention import needs_attention
from dashboard.status_text import (
    FELT_HEADERS,
    NAMES_SHOWN,
    STAGE_HEADERS,
    felt_row,
    printed_lines,
    replica_adapters,
    some_names,
    stage_row,
    table,
    usage_bar,
)
from dashboard.summary import cluster_summary
from dashboard.summary_types import ClusterSummary
from dashboard.team_summary import TeamSummary, team_summary
from hub import get_hub
from keys.budget_use import money
from keys.showback import gpu_hours

DEFAULT_TOP = 10
SCREEN_LINES = 60
"""The default report fits a screen of this many lines, however troubled the fleet (see `render`)."""


@dataclass(frozen=True)
class Shown:
    """Rows each section prints without --all: `models` (those needing a look, then the top holders of GPUs; and
    adapter lines), `rows` (free whole nodes, unplaceable or held models, broken streams), `reasons` (failures,
    most frequent first), `teams` (--teams, the most spent first), `warnings` (node warnings; None: all)."""

    models: int = 8
    rows: int = 5
    reasons: int = 5
    teams: int = 10
    warnings: int | None = None


# When the default would not fit a screen: fewer rows of each section, every section still there with its
# "… and N more" pointer, and at most three stop candidates.
COMPACT = Shown(models=3, rows=1, reasons=1, teams=5, warnings=3)
COMPACT_TOP = 3
CHECK_FAILED = 2
"""Exit status of `--check` when something needs attention (1 stays Django's "the command failed")."""
CLEAR_SCREEN = "\x1b[H\x1b[2J"


class Command(BaseCommand):
    help = "Show the cluster: capacity, free whole nodes, nodes, replicas, models and what can be stopped."
    # A read of the fleet that cron runs every minute and --watch every few seconds: the system checks import
    # every URLconf and view and tell nothing about the fleet (`manage.py check`, migrate and the servers run them).
    requires_system_checks: list[str] = []

    def add_arguments(self, parser):
        parser.add_argument("--json", action="store_true", help="Print the summary as JSON (for scripts).")
        parser.add_argument(
            "--top", type=int, default=DEFAULT_TOP, metavar="N", help="Stop candidates to list (default 10)."
        )
        parser.add_argument(
            "--all", action="store_true", help="Print everything: every node name, replica and stop candidate."
        )
        parser.add_argument("--nodes", action="store_true", help="Print just the list of every node.")
        parser.add_argument("--replicas", action="store_true", help="Print just the list of every replica.")
        parser.add_argument("--models", action="store_true", help="Print just the table of every model.")
        parser.add_argument(
            "--teams", action="store_true", help="Add each team's members, keys, spend and budgets (top 10; --all)."
        )
        parser.add_argument(
            "--check",
            action="store_true",
            help='Print one line; exit 2 when something needs attention, 0 ("ok: ...") otherwise.',
        )
        parser.add_argument("--watch", type=int, metavar="N", help="Redraw every N seconds (N >= 1) until Ctrl-C.")

    # time.sleep, as an attribute so a test can stop the loop without waiting.
    sleep = staticmethod(time.sleep)

    def handle(self, *args, **options):
        if options["top"] < 1:
            raise CommandError(f"--top must be at least 1, got {options['top']}")
        watch = options["watch"]
        if watch is not None and watch < 1:
            raise CommandError(f"--watch must be at least 1 (seconds), got {watch}")
        if watch is not None and options["check"]:
            raise CommandError("--check and --watch do not go together: --check answers once, for a script")
        if options["check"] and options["teams"]:
            raise CommandError("--check and --teams do not go together: --check answers one line")
        if watch is None:
            self.once(options)
            return
        try:
            while True:
                if self.stdout.isatty():
                    self.stdout.write(CLEAR_SCREEN, ending="")
                self.once(options)
                self.sleep(watch)
        except KeyboardInterrupt:
            # Ctrl-C is how --watch is meant to end: no traceback, a clean exit.
            self.stdout.write("")

    def once(self, options: dict) -> None:
        try:
            summary = cluster_summary()
            # Without Redis (embedded mode) the budgets' counters are in the memory of the `llmgw up` process, not
            # this one's: their use is unknown here, never read as zero.
            teams = team_summary(get_hub() if settings.REDIS_URL else None) if options["teams"] else None
        except DatabaseError as exc:
            raise CommandError(
                f"cannot read the fleet from the database ({exc}); has `manage.py migrate` run?"
            ) from None
        problems: list[str] = []
        if options["check"]:
            problems = needs_attention(summary)
            lines = ["attention: " + "; ".join(problems) if problems else "ok: " + self.ok_line(summary)]
        elif options["json"]:
            shown = summary.as_json() | ({"team_summary": teams.as_json()} if teams is not None else {})
            lines = [json.dumps(shown, indent=2)]
        elif options["nodes"] or options["replicas"] or options["models"]:
            lines = (
                (self.node_list(summary) if options["nodes"] else [])
                + (self.models(summary, None) if options["models"] else [])
                + (self.replica_list(summary) if options["replicas"] else [])
                + (self.teams(teams, None) if teams is not None else [])
            )
        else:
            lines = self.render(summary, top=None if options["all"] else options["top"], teams=teams)
        try:
            for line in lines:
                self.stdout.write(line)
            self.stdout.flush()
        except BrokenPipeError:
            # The reader has gone (`ctl_status | head`): that is not an error. Point stdout at
            # /dev/null so the interpreter's final flush cannot raise again on the way out.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        if problems:
            raise SystemExit(CHECK_FAILED)

    @staticmethod
    def ok_line(s: ClusterSummary) -> str:
        gpus = sum(row.total for row in s.capacity)
        used = sum(row.used for row in s.capacity)
        owner, epoch = (s.leader.owner, s.leader.epoch) if s.leader is not None else (None, None)
        return (
            f"{s.nodes.ready} nodes ready, {used}/{gpus} GPUs used, "
            f"{s.replicas.ready} replicas ready, leader {owner} epoch {epoch}"
        )

    def section(self, title: str) -> str:
        return "\n" + self.style.MIGRATE_HEADING(title)

    def styled_table(self, headers: list[str], rows: list[list], row_style=str) -> list[str]:
        lines = table(headers, rows)
        return ["  " + self.style.SQL_FIELD(lines[0])] + ["  " + row_style(line) for line in lines[1:]]

    shown = Shown()

    def render(self, s: ClusterSummary, top: int | None = DEFAULT_TOP, teams: TeamSummary | None = None) -> list[str]:
        """The text report; `top` None is --all (every node name, replica, stop candidate and team). Without --all
        it fits SCREEN_LINES: if the usual rows would not, each section prints COMPACT's, and if even those would
        not, the report is cut with a line saying how much more --all prints."""
        self.shown = Shown()
        out = self.sections(s, top, teams)
        if top is None or printed_lines(out) <= SCREEN_LINES:
            return out
        self.shown = COMPACT
        out = self.sections(s, min(top, COMPACT_TOP), teams)
        if printed_lines(out) <= SCREEN_LINES:
            return out
        kept: list[str] = []
        while printed_lines([*kept, out[len(kept)]]) < SCREEN_LINES:
            kept.append(out[len(kept)])
        return [*kept, f"… and {printed_lines(out) - printed_lines(kept)} more lines (--all)"]

    def sections(self, s: ClusterSummary, top: int | None, teams: TeamSummary | None) -> list[str]:
        out = [self.style.SUCCESS(f"llmgw status at {s.generated_at}")]
        out += self.leader_and_brake(s)
        out += self.node_warnings(s, None if top is None else self.shown.warnings)
        out += self.capacity(s)
        out += self.free_nodes(s, top)
        out.append(self.section("Nodes"))
        out.append("  " + "  ".join(f"{k} {v}" for k, v in s.nodes.items()))
        out.append(self.section("Replicas"))
        out.append("  " + "  ".join(f"{k} {v}" for k, v in s.replicas.items()))
        out += self.models(s, top)
        out += self.unplaceable(s, top)
        out += self.failed(s, top)
        out += self.continuations(s, top)
        out += self.felt(s, top)
        out += self.staging(s, top)
        out += self.what_can_i_stop(s, top)
        if teams is not None:
            out += self.teams(teams, top)
        if top is None:
            out += self.replica_list(s)
        return out

    def leader_and_brake(self, s: ClusterSummary) -> list[str]:
        """Who leads and until when; the partition brake when it is engaged."""
        out = []
        leader = s.leader
        if leader is None:
            out.append(self.style.WARNING("leader: none (no lease taken yet)"))
        else:
            expires = leader.expires_in_seconds
            when = f"expires in {expires:.1f}s" if expires >= 0 else f"EXPIRED {-expires:.1f}s ago"
            line = f"leader: {leader.owner} (epoch {leader.epoch}, lease {when})"
            out.append(line if expires >= 0 else self.style.WARNING(line))
        brake = s.partition_brake
        if brake.engaged:
            out.append(
                self.style.ERROR(
                    f"partition brake: {brake.silent_nodes} of {brake.watched_nodes} nodes are silent; "
                    "none is declared lost and nothing is replaced until they are heard from again "
                    "or an operator declares them lost (admin: nodes)"
                )
            )
        return out

    def capacity(self, s: ClusterSummary) -> list[str]:
        out = [self.section("GPU capacity")]
        if not s.capacity:
            out.append("  no GPUs reported")
        width = max((len(r.gpu_class) for r in s.capacity), default=0)
        for r in s.capacity:
            line = (
                f"  {r.gpu_class.ljust(width)}  {usage_bar(r)}  {r.used}/{r.total} used  {r.free} free"
                f"  {r.unhealthy} unhealthy  {r.unavailable} unavailable"
            )
            out.append(self.style.WARNING(line) if r.unhealthy or r.unavailable else line)
        return out

    def free_nodes(self, s: ClusterSummary, top: int | None) -> list[str]:
        limit = None if top is None else NAMES_SHOWN
        # The fabrics with the most free whole nodes first, when not all are shown.
        ranked = (
            s.free_nodes if top is None else sorted(s.free_nodes, key=lambda r: -r.whole_free_nodes)[: self.shown.rows]
        )
        rows = [[r.fabric or "-", r.gpu_class, r.whole_free_nodes, some_names(r.nodes, limit)] for r in ranked]
        table_lines = self.styled_table(["FABRIC", "GPU CLASS", "FREE", "NODES"], rows) if rows else ["  none"]
        if len(s.free_nodes) > len(ranked):
            table_lines.append(f"  … and {len(s.free_nodes) - len(ranked)} more fabrics and classes (--all)")
        return [self.section("Free whole nodes"), *table_lines]

    def unplaceable(self, s: ClusterSummary, top: int | None) -> list[str]:
        """Models no room was found for: unplaceable (waiting on an operator, in red) apart from held ones (room is
        being made, nodes are reporting in: their requests wait). At most `top` rows each, unless --all."""
        out = []
        for title, rows, style in (
            ("Unplaceable", [u for u in s.unplaceable if not u.held], self.style.ERROR),
            ("Held (room being made, nodes reporting in)", [u for u in s.unplaceable if u.held], str),
        ):
            if not rows:
                continue
            shown = rows if top is None else rows[: self.shown.rows]
            cells = [[u.model, u.pending, " ".join(u.reason.split())] for u in shown]
            out += [self.section(title), *self.styled_table(["MODEL", "PENDING", "REASON"], cells, row_style=style)]
            if len(rows) > len(shown):
                out.append(f"  … and {len(rows) - len(shown)} more (--all)")
        return out

    def failed(self, s: ClusterSummary, top: int | None) -> list[str]:
        """Failed replicas grouped by the first line of their error, most frequent first."""
        groups = s.failed
        if not groups:
            return []
        out = [self.section("Failed replicas")]
        shown = groups if top is None else groups[: self.shown.reasons]
        limit = None if top is None else NAMES_SHOWN
        rows = [[g.replicas, some_names(g.models, limit), g.reason] for g in shown]
        out += self.styled_table(["REPLICAS", "MODELS", "REASON"], rows, row_style=self.style.ERROR)
        if len(groups) > len(shown):
            out.append(f"  … and {len(groups) - len(shown)} more reasons (--all)")
        return out

    def continuations(self, s: ClusterSummary, top: int | None) -> list[str]:
        """Answers whose engine broke off over the last hour, per model: continued on another replica, ended with
        an error, refused (continuing would have changed the answer), and the prompt tokens engines re-read."""
        broken = s.continuations
        since = datetime.fromisoformat(broken.since).strftime("%H:%M")
        out = [self.section(f"Stream continuations (since {since} UTC)")]
        if not broken.models:
            return [*out, "  none: no engine broke off an answer"]
        shown = broken.models if top is None else broken.models[: self.shown.rows]
        rows = [[m.model, m.continued, m.failed, m.refused, m.reprocessed_prompt_tokens] for m in shown]
        out += self.styled_table(["MODEL", "CONTINUED", "FAILED", "REFUSED", "PROMPT TOKENS RE-READ"], rows)
        if len(broken.models) > len(shown):
            out.append(f"  … and {len(broken.models) - len(shown)} more models (--all)")
        return out

    def felt(self, s: ClusterSummary, top: int | None) -> list[str]:
        """What users felt per model over the routers' last window, the most pressed first (status_text.felt_row)."""
        window = f"{settings.LLMGW_LATENCY_WINDOW_SECONDS:g} s"
        out = [self.section(f"What users felt (the routers' last {window}; WITHIN: share within the objectives)")]
        if not s.felt:
            return [*out, "  none: no model streamed or queued"]
        shown = s.felt if top is None else s.felt[: self.shown.rows]
        out += self.styled_table(FELT_HEADERS, [felt_row(m) for m in shown])
        if len(s.felt) > len(shown):
            out.append(f"  … and {len(s.felt) - len(shown)} more models (--all)")
        return out

    def staging(self, s: ClusterSummary, top: int | None) -> list[str]:
        """Weights being staged on nodes (and stages ended in the last hour); nothing when there are none."""
        if not s.staging:
            return []
        out = [self.section("Staging weights (and stages ended in the last hour)")]
        shown = s.staging if top is None else s.staging[: self.shown.rows]
        out += self.styled_table(STAGE_HEADERS, [stage_row(stage) for stage in shown])
        if len(s.staging) > len(shown):
            out.append(f"  … and {len(s.staging) - len(shown)} more stages (--all)")
        return out

    def teams(self, t: TeamSummary, top: int | None) -> list[str]:
        """Each team, the most spent this month first: members, usable keys, spend today and this month (UTC days
        and months), and its own budgets in their windows; `shown.teams` rows unless --all (`top` None)."""
        out = [self.section("Teams (spend today and this month, UTC)")]
        if not t.teams:
            return [*out, "  no team"]
        shown = t.teams if top is None else t.teams[: self.shown.teams]
        rows = [
            [
                team.name, team.members, team.active_keys, money(team.spend_today_units),
                money(team.spend_month_units), gpu_hours(team.gpu_seconds_month),
                "; ".join(budget.text() for budget in team.budgets) or "no budget",
            ]
            for team in shown
        ]  # fmt: skip
        out += self.styled_table(["TEAM", "MEMBERS", "KEYS", "TODAY", "THIS MONTH", "GPU-H", "BUDGET"], rows)
        if len(t.teams) > len(shown):
            out.append(f"  … and {len(t.teams) - len(shown)} more teams (--all)")
        out.append(
            f"  GPU-hours this month besides teams: {gpu_hours(t.gpu_seconds_month_no_team)} keys of no team, "
            f"{gpu_hours(t.gpu_seconds_month_idle)} idle (`manage.py showback` for any month)"
        )
        if not t.budgets_known:
            where = (
                "Redis did not answer"
                if settings.REDIS_URL
                else "in embedded mode the counters are in the `llmgw up` process (see its /metrics)"
            )
            out.append(self.style.WARNING(f"  budgets' use is unknown (-): {where}"))
        return out

    def node_list(self, s: ClusterSummary) -> list[str]:
        out = [self.section("Node list")]
        rows = [
            [
                n.name,
                n.fabric or "-",
                n.state + ("" if n.schedulable else ",cordoned"),
                n.gpus,
                n.used,
                n.free,
                n.unhealthy,
                n.unavailable,
                n.last_seen or "-",
            ]
            for n in s.node_list
        ]
        headers = ["NODE", "FABRIC", "STATE", "GPUS", "USED", "FREE", "UNHEALTHY", "UNAVAILABLE", "LAST SEEN"]
        out += self.styled_table(headers, rows) if rows else ["  none"]
        out.append(self.section("Weights on disk"))
        held = [[n.name, w.source, w.size] for n in s.node_list for w in n.weights]
        out += self.styled_table(["NODE", "SOURCE", "SIZE"], held) if held else ["  none reported"]
        return out + self.node_warnings(s)

    def node_warnings(self, s: ClusterSummary, limit: int | None = None) -> list[str]:
        """Nodes whose operator-set address, fabric or labels disagree with what their agents report (`limit`
        lines at most, then how many more --nodes lists)."""
        lines = [
            f"node {n.name}: {warning} (the operator's value is used)" for n in s.node_list for warning in n.warnings
        ]
        shown = lines if limit is None else lines[:limit]
        more = [f"… and {len(lines) - len(shown)} more node warnings (--nodes)"] if len(lines) > len(shown) else []
        return [self.style.WARNING(line) for line in shown + more]

    def what_can_i_stop(self, s: ClusterSummary, top: int | None) -> list[str]:
        out = [self.section("What can I stop")]
        usage = s.usage
        if not usage.known:
            out.append(
                self.style.WARNING(
                    f"  usage is unknown ({usage.reason}): nothing counts as idle, "
                    "so idle stops and evictions wait until it is known again"
                )
            )
            return out
        held = s.idle_held_gpus
        per_class = ", ".join(f"{r.gpu_class} {r.gpus}" for r in held.by_class if r.gpus)
        out.append(f"  {held.total} GPUs held by replicas idle over an hour" + (f" ({per_class})" if per_class else ""))
        entries = s.stoppable
        if not entries:
            out.append("  no replica is known idle and free to stop")
            return out
        shown = entries if top is None else entries[:top]
        rows = [
            [e.replica, e.model, e.gpus, ",".join(e.nodes) or "-", e.idle, e.frees, ", ".join(e.unblocks) or "-"]
            for e in shown
        ]
        out += self.styled_table(["REPLICA", "MODEL", "GPUS", "NODES", "IDLE", "FREES", "UNBLOCKS"], rows)
        if len(entries) > len(shown):
            out.append(f"  … and {len(entries) - len(shown)} more (--all)")
        return out

    def models(self, s: ClusterSummary, top: int | None) -> list[str]:
        """One row per model: enabled, wanted, GPUs held, and its replicas counted per state. Without --all (`top`
        None) or --models, only the models that need a look (wanted but not all ready, or with failed replicas)
        and then the top holders of GPUs, `shown.models` rows in all: catalogs have hundreds of models."""
        counts: dict[str, Counter] = defaultdict(Counter)
        gpus: Counter = Counter()
        for r in s.replica_list:
            counts[r.model][r.state] += 1
            gpus[r.model] += r.gpus
        states = [state for state, _ in s.replicas.items() if state != "total"]
        chosen = list(s.models)
        if top is not None:
            # Attention first (the most replicas short first), then the biggest holders of GPUs.
            chosen.sort(key=lambda m: (-(m.wanted - m.ready + counts[m.name]["failed"]), -gpus[m.name], m.name))
            chosen = chosen[: self.shown.models]
        rows = [
            [m.name, "yes" if m.enabled else "no", m.wanted, gpus[m.name]] + [counts[m.name][state] for state in states]
            for m in chosen
        ]
        headers = ["MODEL", "ENABLED", "WANTED", "GPUS"] + [state.upper() for state in states]
        title = self.section("Models") + (" (--replicas lists every replica)" if top is not None else "")
        out = [title] + (self.styled_table(headers, rows) if rows else ["  none"])
        if len(s.models) > len(chosen):
            out.append(f"  … and {len(s.models) - len(chosen)} more models (--models lists them all)")
        return out + self.adapters(s, top)

    def adapters(self, s: ClusterSummary, top: int | None = None) -> list[str]:
        """One line per base model with LoRA adapters, of counts: fleets have thousands of adapters."""
        bases = [m for m in s.models if m.adapters.shown]
        shown = bases if top is None else bases[: self.shown.rows]
        width = max((len(m.name) for m in shown), default=0)
        lines = []
        for m in shown:
            a = m.adapters
            lines.append(
                f"  adapters  {m.name.ljust(width)}  {a.registered} registered, {a.loaded} loaded, "
                f"{a.loading} loading, {a.slots} slots"
            )
        if len(bases) > len(shown):
            lines.append(f"  … and {len(bases) - len(shown)} more base models with adapters (--models)")
        return lines

    def replica_list(self, s: ClusterSummary) -> list[str]:
        out = [self.section("Replica list")]
        rows = [
            [
                r.id,
                r.model,
                r.state,
                ",".join(r.nodes) or "-",
                r.gpus,
                replica_adapters(r),
                r.endpoint or "-",
                str(r.idle),
            ]
            for r in s.replica_list
        ]
        out += (
            self.styled_table(["ID", "MODEL", "STATE", "NODES", "GPUS", "ADAPTERS", "ENDPOINT", "IDLE"], rows)
            if rows
            else ["  none"]
        )
        return out
