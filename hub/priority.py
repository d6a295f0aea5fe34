"""Priority classes: which requests leave a full model's fair queue first (router.picking.admission).

Set on a team and on a key (a key's own class, else its team's, else standard); a request may ask for a lower class
than its key's (the `LLMGW-Priority` header), never a higher one. Batch is served from spare capacity only: it never
takes the room the classes above it need.
"""

from __future__ import annotations

from django.db import models


class PriorityClass(models.TextChoices):
    """A request's class: interactive leaves a full model's queue first, batch last and from spare capacity only."""

    INTERACTIVE = "interactive", "interactive"
    STANDARD = "standard", "standard"
    BATCH = "batch", "batch"


RANKS = {PriorityClass.INTERACTIVE.value: 0, PriorityClass.STANDARD.value: 1, PriorityClass.BATCH.value: 2}
"""Class name -> its rank in the queue (0 leaves first)."""
NAMES = {rank: name for name, rank in RANKS.items()}
STANDARD = RANKS[PriorityClass.STANDARD.value]
BATCH = RANKS[PriorityClass.BATCH.value]
MAX_TEAM_WEIGHT = 1000
