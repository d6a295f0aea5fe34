"""A stable digest of an endpoint table, so it is pushed only when it changes (DESIGN invariant 7)."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def fingerprint(table: dict[str, Any]) -> str:
    """A stable digest of an endpoint table (its own fingerprint field excluded)."""
    body = {k: v for k, v in table.items() if k != "fingerprint"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
