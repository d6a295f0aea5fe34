"""A stable digest of an endpoint table, so it is pushed only when it changes (DESIGN invariant 7)."""

from __future__ import annotations

import hashlib

import msgspec

from hub.contracts import EndpointTable


def fingerprint(table: EndpointTable) -> str:
    """A stable digest of an endpoint table (its own fingerprint field excluded)."""
    body = msgspec.structs.replace(table, fingerprint="")
    return hashlib.sha256(msgspec.json.encode(body, order="sorted")).hexdigest()


def fingerprinted(table: EndpointTable) -> tuple[EndpointTable, bytes]:
    """`table` with its fingerprint set, and its JSON as routers decode it."""
    table = msgspec.structs.replace(table, fingerprint=fingerprint(table))
    return table, msgspec.json.encode(table)
