"""Answers the router gives itself: RouterError and OpenAI's error shape.

Every error a client sees from the router (not relayed from an engine) is a
RouterError carrying its HTTP status, an OpenAI-style code and any headers
(Allow, Retry-After).
"""

from __future__ import annotations

import json


def error_body(message: str, type_: str, code: str | None, param: str | None = None) -> bytes:
    """An error in OpenAI's shape."""
    return json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}).encode()


class RouterError(Exception):
    """A request the router answers itself, with an HTTP status and an OpenAI-shaped error."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.type, self.param = status, message, code, type_, param
        self.headers = headers or []

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code, self.param)


class EngineEndedUnfinished(Exception):
    """An engine ended a continuable stream itself before its answer was done (finish_reason abort, or an error
    event): a break like a lost connection, raised before the event that says so reaches the client."""

    def __init__(self, event: bytes) -> None:
        super().__init__(event[:200].decode(errors="replace").strip())


class ReplicaLeaving(Exception):
    """The control plane asked the routers to move the streams of a replica leaving service (a drain or a sleep
    past its wait, router.forwarding.moves): the router cut the stream between two chunks, to continue it elsewhere."""

    def __init__(self) -> None:
        super().__init__("its replica is leaving service (a drain or a sleep)")


def method_not_allowed(method: str, path: str, allowed: bytes) -> RouterError:
    """405 naming the method that is allowed on `path`."""
    return RouterError(
        405,
        f"Method {method} is not allowed on {path}; use {allowed.decode()}.",
        "method_not_allowed",
        headers=[(b"allow", allowed)],
    )


def shutting_down() -> RouterError:
    """503 for a request that reaches a router on its way out: another router (or this one restarted) takes it."""
    return RouterError(
        503,
        "This router is shutting down and takes no new requests; retry (another router will answer).",
        "shutting_down",
        type_="server_error",
        headers=[(b"retry-after", b"1"), (b"connection", b"close")],
    )
