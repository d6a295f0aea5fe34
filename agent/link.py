"""The agent's stream to the control plane: connect, greet, keep alive, reconnect.

The link authenticates with the node's credential, rotates through several
control-plane addresses when one fails (DESIGN invariant 9), and backs off
with jitter between attempts. A refused credential or a newer connection for
the same node (invariant 8) ends it with AgentRejected or AgentSuperseded:
retrying would not help, and two agents must not fight over one node.

wss:// addresses are verified against `ca_file` (a PEM bundle; the system's
trusted CAs without it), and `cert_file`/`key_file` give the node's own
certificate to a control plane that requires one (mutual TLS). A certificate
the agent cannot trust is logged as an error naming the address and the
reason; once every address has failed that way in a row the link gives up
with AgentTLSError instead of retrying a misconfiguration forever.

It knows nothing of what the messages mean; agent/runtime.py supplies them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import ssl
from collections.abc import Awaitable, Callable

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidMessage, InvalidStatus, InvalidURI

from nodewire.control_planes import address_problem
from nodewire.protocol import CLOSE_SUPERSEDED, CLOSE_UNAUTHORIZED

log = logging.getLogger(__name__)
# websockets logs the handshake's headers and every frame at DEBUG: the node token, and start_shard's
# engine env with its secret values (nodewire/engine_env.py). Its lines for the link go here, kept at INFO.
_wire_log = logging.getLogger(f"{__name__}.wire")
_wire_log.setLevel(logging.INFO)

BACKOFF_FIRST_SECONDS = 0.2
BACKOFF_MAX_SECONDS = 30.0
# Each heartbeat interval is the configured one ±10%.
HEARTBEAT_JITTER = 0.1


class AgentRejected(Exception):
    """The control plane refused this node's credential; retrying would not help."""


class AgentSuperseded(AgentRejected):
    """Another connection for this node replaced ours; this process no longer speaks for the node."""


class AgentTLSError(AgentRejected):
    """No control plane presented a certificate this agent trusts (or they refused its own); retrying would not help."""


def client_tls_context(
    ca_file: str | None, cert_file: str | None = None, key_file: str | None = None
) -> ssl.SSLContext:
    """The TLS settings for wss:// addresses: verify the server against `ca_file`, present `cert_file` if given.

    ValueError names a file that cannot be loaded.
    """
    try:
        context = ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load the CA bundle {ca_file!r}: {exc}") from None
    if cert_file:
        try:
            context.load_cert_chain(cert_file, key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot load the node certificate {cert_file!r} (key {key_file!r}): {exc}") from None
    return context


def _ssl_error(exc: BaseException) -> ssl.SSLError | None:
    """The TLS failure behind a failed handshake, if that is what it was.

    With TLS 1.3 a server refuses a client certificate after the client has
    finished its side, so the refusal surfaces while the HTTP answer is read.
    """
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


class ControlPlaneLink:
    """One node's connection to whichever control-plane process answers; `await run(...)` holds it."""

    def __init__(
        self,
        control_planes: list[str],
        node: str,
        token: str,
        heartbeat_seconds: float,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
    ):
        if not control_planes:
            raise ValueError("an agent needs at least one control-plane address")
        for uri in control_planes:
            problem = address_problem(uri)
            if problem is not None:
                raise ValueError(problem)
        if not node:
            raise ValueError("an agent needs a node name")
        if not token:
            raise ValueError("an agent needs its node credential (token)")
        if heartbeat_seconds <= 0:
            raise ValueError(f"heartbeat interval must be positive, got {heartbeat_seconds}")
        self.control_planes = list(control_planes)
        self.node = node
        self.token = token
        self.heartbeat_seconds = heartbeat_seconds
        self.ca_file = ca_file
        secure = any(uri.startswith("wss://") for uri in control_planes)
        self._presents_certificate = bool(cert_file)
        self._tls = client_tls_context(ca_file, cert_file, key_file) if secure else None
        self.closing = asyncio.Event()
        self._ws: ClientConnection | None = None
        # One frame at a time: heartbeats and replies come from different tasks.
        self._send_lock = asyncio.Lock()

    async def run(
        self,
        hello: Callable[[], bytes],
        heartbeat: Callable[[], Awaitable[bytes]],
        receive: Callable[[str | bytes], Awaitable[None]],
    ) -> None:
        """Hold the stream until close(); raise AgentRejected if the control plane refuses the node.

        Each connection starts with `hello()`, sends `await heartbeat()` every
        interval (however long building it took), and hands every frame received to `receive`. Connection
        losses are retried with backoff, rotating through the addresses.
        """
        failures = 0
        tls_failures = 0
        turn = 0
        while not self.closing.is_set():
            uri = self.control_planes[turn % len(self.control_planes)]
            try:
                ws = await self._connect(uri)
                if ws is None:
                    return
                failures = tls_failures = 0
                await self._session(ws, uri, hello, heartbeat, receive)
            except InvalidStatus as exc:
                status = exc.response.status_code
                if status in (401, 403):
                    raise AgentRejected(
                        f"control plane {uri} refused node “{self.node}” (HTTP {status}): "
                        "its credential is wrong or revoked; enrol the node again"
                    ) from None
                log.warning("control plane %s answered HTTP %s to the agent handshake", uri, status)
            except InvalidURI as exc:
                raise ValueError(f"control-plane address {uri!r} is not a WebSocket URI: {exc}") from None
            except (ssl.SSLError, InvalidMessage) as exc:
                tls_error = _ssl_error(exc)
                if tls_error is None:
                    hint = self._handshake_hint(uri)
                    log.warning("control plane %s did not answer the WebSocket handshake%s: %s", uri, hint, exc)
                else:
                    tls_failures += 1
                    reason = self._tls_reason(tls_error)
                    log.error("TLS with control plane %s failed: %s", uri, reason)
                    if tls_failures >= len(self.control_planes):
                        raise AgentTLSError(
                            f"no control plane completed TLS with node “{self.node}”; last, {uri}: {reason}"
                        ) from None
            except (OSError, TimeoutError, InvalidHandshake, ConnectionClosed) as exc:
                if isinstance(exc, ConnectionClosed):
                    self._check_close(exc.rcvd.code if exc.rcvd else None, uri)
                log.warning("control plane %s unreachable or lost: %s", uri, exc or type(exc).__name__)
            if self.closing.is_set():
                return
            turn += 1
            delay = min(BACKOFF_MAX_SECONDS, BACKOFF_FIRST_SECONDS * 2 ** min(failures, 16))
            failures += 1
            # Jitter keeps a fleet that lost its control plane from reconnecting in lockstep.
            delay *= random.uniform(0.8, 1.2)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.closing.wait(), delay)

    def _handshake_hint(self, uri: str) -> str:
        """What an unanswered WebSocket handshake most likely means for this address."""
        if uri.startswith("ws://"):
            return " (is it a wss:// address?)"
        if self._presents_certificate:
            # Under TLS 1.3 the server judges the client certificate after the client's side of the
            # handshake is done, and a refusal reaches the client as the connection closing.
            return " (was this node's certificate refused? check --cert-file against the control plane's client CA)"
        return ""

    def _tls_reason(self, exc: ssl.SSLError) -> str:
        if isinstance(exc, ssl.SSLCertVerificationError):
            trust = f"the CA bundle {self.ca_file}" if self.ca_file else "the system's trusted CAs (give --ca-file)"
            return f"its certificate is not trusted by {trust}: {exc.verify_message}"
        if "WRONG_VERSION_NUMBER" in str(exc) or "record layer" in str(exc):
            return f"it does not speak TLS (is it a ws:// address?): {exc}"
        return str(exc)

    async def send(self, frame: bytes, ws: ClientConnection | None = None) -> bool:
        """Send a JSON frame on the current stream; a lost frame is fine, `hello` re-reports on reconnect."""
        ws = ws or self._ws
        if ws is None:
            return False
        try:
            async with self._send_lock:
                # A text frame, as JSON is; the bytes are sent as they are, without decoding.
                await ws.send(frame, text=True)
        except ConnectionClosed:
            return False
        return True

    async def close(self) -> None:
        """Stop reconnecting and close the stream; safe to call more than once."""
        self.closing.set()
        ws = self._ws
        if ws is not None:
            with contextlib.suppress(Exception):
                await ws.close()

    async def _connect(self, uri: str) -> ClientConnection | None:
        """Open the stream, or return None if close() comes first."""
        headers = {"Authorization": f"Bearer {self.token}", "X-Llmgw-Node": self.node}
        opening = asyncio.ensure_future(
            connect(
                uri,
                additional_headers=headers,
                proxy=None,
                open_timeout=10,
                close_timeout=5,
                # No permessage-deflate: frames are small JSON, and compressing each one costs both ends
                # CPU a fleet's worth of times over for a few bytes.
                compression=None,
                # An ssl context only for wss:// (websockets refuses one for ws://).
                ssl=self._tls if uri.startswith("wss://") else None,
                logger=_wire_log,
            )
        )
        closing = asyncio.ensure_future(self.closing.wait())
        try:
            await asyncio.wait({opening, closing}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            closing.cancel()
        if not opening.done():
            opening.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await opening
            return None
        ws = opening.result()
        if self.closing.is_set():
            await ws.close()
            return None
        return ws

    def _check_close(self, code: int | None, uri: str) -> None:
        if code == CLOSE_UNAUTHORIZED:
            raise AgentRejected(f"control plane {uri} closed the stream: node “{self.node}” is not authorised")
        if code == CLOSE_SUPERSEDED:
            raise AgentSuperseded(
                f"control plane {uri} closed the stream: another agent connected as node “{self.node}”; "
                "this one stops so the two do not fight over the node's engines"
            )

    async def _session(
        self,
        ws: ClientConnection,
        uri: str,
        hello: Callable[[], bytes],
        heartbeat: Callable[[], Awaitable[bytes]],
        receive: Callable[[str | bytes], Awaitable[None]],
    ) -> None:
        self._ws = ws
        beats = asyncio.create_task(self._heartbeats(ws, heartbeat), name=f"agent-{self.node}-heartbeat")
        try:
            await self.send(hello())
            log.info("agent %s connected to %s", self.node, uri)
            async for raw in ws:
                await receive(raw)
            # A clean close by the peer ends the iteration without raising.
            if not self.closing.is_set():
                self._check_close(ws.close_code, uri)
                log.warning("control plane closed the stream (code %s)", ws.close_code)
        finally:
            beats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beats
            self._ws = None

    def heartbeat_delays(self):
        """Seconds before each heartbeat, from the start of a session: the first at a random point of one
        interval, then every interval ±10%, so a fleet that (re)connected together does not beat together."""
        yield random.uniform(0, self.heartbeat_seconds)
        while True:
            yield self.heartbeat_seconds * random.uniform(1 - HEARTBEAT_JITTER, 1 + HEARTBEAT_JITTER)

    async def _heartbeats(self, ws: ClientConnection, heartbeat: Callable[[], Awaitable[bytes]]) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        for delay in self.heartbeat_delays():
            # On a cadence: the time spent reading engines' load comes out of the wait, not on top of it.
            due = max(due + delay, loop.time())
            await asyncio.sleep(due - loop.time())
            await self.send(await heartbeat(), ws)
