"""TLS for the agent link: the peer certificate in the ASGI scope, and the node it names.

uvicorn verifies a client certificate against `--ssl-ca-certs` but does not
hand it to the application. `TLSWebSocketProtocol` is uvicorn's WebSocket
protocol plus the ASGI TLS extension (`scope["extensions"]["tls"]`, with
`client_cert_chain` as PEM strings, the client's own certificate first), read
from the connection's SSL object. Run the control plane with
`--ws agentlink.tls:TLSWebSocketProtocol` (`manage.py up` does so itself).

With mutual TLS on (LLMGW_TLS_CLIENT_CA_FILE), an agent must present a
certificate whose subject common name (CN) is the name of the node its
credential belongs to; subject alternative names are not consulted, so one
rule holds whatever a CA puts there.
"""

from __future__ import annotations

import ssl

from cryptography import x509
from cryptography.x509.oid import NameOID
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

# ASGI TLS extension: the TLS version as its 16-bit protocol number.
TLS_VERSIONS = {"TLSv1": 0x0301, "TLSv1.1": 0x0302, "TLSv1.2": 0x0303, "TLSv1.3": 0x0304}


def tls_extension(ssl_object: ssl.SSLObject) -> dict:
    """The ASGI TLS extension for one connection (server certificate and cipher suite id are not known here)."""
    der = ssl_object.getpeercert(binary_form=True)
    chain = [ssl.DER_cert_to_PEM_cert(der)] if der else []
    name = x509.load_der_x509_certificate(der).subject.rfc4514_string() if der else None
    return {
        "server_cert": None,
        "client_cert_chain": chain,
        "client_cert_name": name,
        "client_cert_error": None,
        "tls_version": TLS_VERSIONS.get(ssl_object.version() or ""),
        "cipher_suite": None,
    }


class TLSWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol (the one `--ws auto` picks) that also fills in the ASGI TLS extension on TLS connections."""

    async def run_asgi(self) -> None:
        ssl_object = self.transport.get_extra_info("ssl_object")
        if ssl_object is not None:
            self.scope["extensions"]["tls"] = tls_extension(ssl_object)
        await super().run_asgi()


def client_common_name(scope: dict) -> str | None:
    """The CN of the client certificate in the scope's TLS extension, or None if there is none."""
    chain = (scope.get("extensions") or {}).get("tls", {}).get("client_cert_chain") or []
    if not chain:
        return None
    names = x509.load_pem_x509_certificate(chain[0].encode()).subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""


def has_tls_extension(scope: dict) -> bool:
    """Whether the server filled in the ASGI TLS extension (it does only on TLS connections, and only ours)."""
    return "tls" in (scope.get("extensions") or {})
