"""How long a replica has been idle, where "unknown" is a value of its own (DESIGN invariant 3).

A replica's last use is a timestamp or unknown. Unknown is never idle: it is
`-` in text, negative in JSON (with `idle_known: false` beside it), absent
from anything that ranks or evicts. Every surface that shows idleness — the
replica model, the cluster summary, the REST API, admin, `ctl_status`, the
dashboard — goes through `Idle`, so the rule is written once.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

UNKNOWN_SECONDS = -1.0


@dataclass(frozen=True)
class Idle:
    """Seconds since last use, or unknown (`seconds is None`)."""

    seconds: float | None

    @classmethod
    def since(cls, last_used: datetime | None, now: datetime) -> Idle:
        """Idle time at `now` of a replica last used at `last_used` (None: unknown)."""
        if last_used is None:
            return UNKNOWN
        return cls(round(max(0.0, (now - last_used).total_seconds()), 3))

    @classmethod
    def from_json(cls, seconds: float | None, known: bool = True) -> Idle:
        """The value back from its JSON form (`idle_seconds`, `idle_known`)."""
        if not known or seconds is None or seconds < 0:
            return UNKNOWN
        return cls(float(seconds))

    @property
    def known(self) -> bool:
        return self.seconds is not None

    def json_seconds(self) -> float:
        """The JSON form: seconds, or -1 when unknown (always sent beside `known`)."""
        return UNKNOWN_SECONDS if self.seconds is None else self.seconds

    def as_json(self) -> dict[str, float | bool]:
        """`{"idle_seconds": …, "idle_known": …}` for APIs."""
        return {"idle_seconds": self.json_seconds(), "idle_known": self.known}

    def __str__(self) -> str:
        """A human idle time like `3m12s`; `-` when unknown."""
        if self.seconds is None:
            return "-"
        seconds = int(self.seconds)
        days, seconds = divmod(seconds, 86400)
        hours, seconds = divmod(seconds, 3600)
        minutes, seconds = divmod(seconds, 60)
        if days:
            return f"{days}d{hours:02d}h"
        if hours:
            return f"{hours}h{minutes:02d}m"
        if minutes:
            return f"{minutes}m{seconds:02d}s"
        return f"{seconds}s"


UNKNOWN = Idle(None)
