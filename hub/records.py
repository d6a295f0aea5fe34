"""A router's record of one request, for the per-request log: what travels in its usage reports (hub.contracts.
UsageReport.records) and what the control plane stores (keys.records)."""

from __future__ import annotations

from typing import Annotated

import msgspec

# The wire's basic types (hub.contracts uses them too).
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Name = Annotated[str, msgspec.Meta(min_length=1)]
# Unix seconds; the bound refuses inf (and NaN fails every comparison), which the hubs could not store.
UnixTime = Annotated[float, msgspec.Meta(ge=0, le=1e11)]


class RequestRecord(msgspec.Struct, kw_only=True, array_like=True, frozen=True):
    """One request as its router saw it, for the per-request log (keys.models.RequestRecord, kept
    LLMGW_REQUEST_RECORD_DAYS days); an array on the wire: `[at, key, model, status, prompt, completion, spend,
    milliseconds]`."""

    at: UnixTime
    """When the router received it."""
    key: Name
    """The API key's digest."""
    model: Name
    status: Annotated[int, msgspec.Meta(ge=0, le=999)]
    """The answer's HTTP status (499: the client left first)."""
    prompt: NonNegative
    completion: NonNegative
    spend: NonNegative
    """What it was charged, in hub.budgets.SPEND_UNITS."""
    milliseconds: NonNegative
    """From its arrival to its answer's end."""
