"""Text pieces of `ctl_status`'s report: bars, name lists, aligned tables, and the rows of its sections that need
more than a line of formatting (what users felt per model, weights being staged)."""

from __future__ import annotations

from dashboard.summary_types import Capacity, ModelFelt, ReplicaStatus, StageStatus

BAR_WIDTH = 16
NAMES_SHOWN = 3
"""Node names printed per (fabric, class) in "Free whole nodes" without --all."""


def usage_bar(row: Capacity, width: int = BAR_WIDTH) -> str:
    """`[####!!x---------]`: used `#`, unhealthy `!`, unavailable `x`, free `-`."""
    total = row.total
    if not total:
        return "[" + " " * width + "]"
    cells = []
    for count, mark in ((row.used, "#"), (row.unhealthy, "!"), (row.unavailable, "x")):
        cells.append(mark * round(count * width / total))
    bar = "".join(cells)[:width]
    return "[" + bar + "-" * (width - len(bar)) + "]"


def some_names(names: list[str], limit: int | None = NAMES_SHOWN) -> str:
    """`gpu-0001, gpu-0002, gpu-0003 and 184 more` (all of them when `limit` is None); `-` for none."""
    if not names:
        return "-"
    if limit is None or len(names) <= limit:
        return ", ".join(names)
    return f"{', '.join(names[:limit])} and {len(names) - limit} more"


def replica_adapters(replica: ReplicaStatus) -> str:
    """A replica's LoRA adapters: `3` loaded, `3+1` while one more loads (one word, like every cell)."""
    loading = f"+{replica.adapters_loading}" if replica.adapters_loading else ""
    return f"{replica.adapters_loaded}{loading}"


def printed_lines(lines: list[str]) -> int:
    """Lines on the screen: a section's title starts with a blank line of its own."""
    return sum(line.count("\n") + 1 for line in lines)


def table(headers: list[str], rows: list[list]) -> list[str]:
    """Left-aligned columns, two spaces apart; the first line is the header."""
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]


FELT_HEADERS = [
    "MODEL",
    "TTFT P90",
    "ITL P90",
    "WITHIN",
    "PRESSURE",
    "PARKED",
    "WAITING",
    "WAIT P90",
    "TEAMS SERVED (WEIGHTED)",
]


def felt_row(m: ModelFelt) -> list:
    """One model's figures over the routers' window: p90s against their objectives, the share within each, the
    pressure, its replicas parked out of rotation, its queues per class (waiting now; the worst class's p90 wait) and each team's share of the tokens
    against the share its weight asks for."""
    within = [f"{share:.0%}" for share in (m.ttft_attained, m.itl_attained) if share is not None]
    waiting = " ".join(f"{q.name[0]}{q.waiting}" for q in m.queue) or "-"
    waits = [q.wait_p90_seconds for q in m.queue if q.wait_p90_seconds is not None]
    teams = " ".join(f"{t.team} {t.share:.0%}({t.weighted_share:.0%})" for t in m.shares[:3])
    if len(m.shares) > 3:
        teams += f" +{len(m.shares) - 3}"
    return [
        m.model,
        _against(m.ttft_p90_seconds, m.ttft_objective_seconds),
        _against(m.itl_p90_seconds, m.itl_objective_seconds),
        "/".join(within) or "-",
        "-" if m.pressure is None else f"{m.pressure:.2f}",
        m.parked,
        waiting,
        _seconds(max(waits, default=None)),
        teams or "-",
    ]


def _against(p90: float | None, objective: float | None) -> str:
    return _seconds(p90) + ("" if objective is None else f"/{_seconds(objective)}")


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}s" if value < 1 else f"{value:.1f}s"


STAGE_HEADERS = ["NODE", "SOURCE", "STATE", "DONE", "RATE", "LEFT"]


def stage_row(stage: StageStatus) -> list:
    """One stage: `41% of 2.1 GB`, `52.3 MB/s`, `25s` left (the failure's words in place of the figures)."""
    if stage.state == "failed":
        return [stage.node, stage.source, stage.state, stage.message[:60] or "-", "-", "-"]
    total = f"{stage.bytes_total / 1e9:.1f} GB" if stage.bytes_total else "? GB"
    done = "-" if stage.fraction is None else f"{stage.fraction:.0%} of {total}"
    rate = f"{stage.bytes_per_second / 1e6:.1f} MB/s" if stage.bytes_per_second else "-"
    left = "-" if stage.seconds_left is None else _seconds(stage.seconds_left)
    return [stage.node, stage.source, stage.state, done, rate, left]
