"""TLS on the router's public endpoints: the config (a server certificate, and a client CA for
mutual TLS), loading and checking its PEM files, and binding the gRPC port with them (an IPv6
host in brackets, as gRPC spells it).

The files are read when a server starts (a renewed certificate takes a restart). Before
either server uses them, `load_tls` checks them with the standard library's `ssl` (the module
the HTTP server uses): a certificate that is not PEM, or a key that does not match it, fails
the start with a message naming the files, where gRPC alone would only log it and then fail
every handshake.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from splitserve.common.validation import require

TLS_FILE_FIELDS = ("cert_file", "key_file", "client_ca_file")


@dataclass(frozen=True)
class TlsConfig:
    """The router's certificate, and who may connect (any client, or only holders of a
    certificate signed by `client_ca_file`). Paths are checked to name existing files."""

    cert_file: str
    """PEM certificate chain the router presents: its own certificate first, then any
    intermediates. Its subject alternative names must cover the name or IP address clients
    connect to (e.g. `router.example.com`, `127.0.0.1`)."""
    key_file: str
    """PEM private key of cert_file's certificate, unencrypted."""
    client_ca_file: str | None = None
    """PEM CA certificate(s). When set, every client must present a certificate signed by one of
    them (mutual TLS); a client without one is refused during the handshake. None: clients are
    not asked for a certificate."""

    def __post_init__(self) -> None:
        for name in TLS_FILE_FIELDS:
            path = getattr(self, name)
            if path is None and name == "client_ca_file":
                continue
            require(isinstance(path, str) and path != "" and Path(path).is_file(),
                     f"{name} must name an existing file, got {path!r}")

    @property
    def requires_client_certificate(self) -> bool:
        return self.client_ca_file is not None


@dataclass(frozen=True)
class TlsCredentials:
    """The PEM bytes of a checked TlsConfig."""

    certificate_chain: bytes
    private_key: bytes
    client_ca: bytes | None
    """None when client certificates are not required."""


def load_tls(config: TlsConfig) -> TlsCredentials:
    """Read and check the files: the certificate chain and the key must be PEM and belong
    together, and the client CA file must hold at least one PEM certificate. ValueError names
    the file at fault."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(config.cert_file, config.key_file)
    except (ssl.SSLError, OSError) as error:
        raise ValueError(f"TLS: cert_file {config.cert_file!r} and key_file {config.key_file!r} are not a PEM "
                         f"certificate chain and its private key: {error}") from None
    if config.client_ca_file is not None:
        try:
            context.load_verify_locations(cafile=config.client_ca_file)
        except (ssl.SSLError, OSError) as error:
            raise ValueError(f"TLS: client_ca_file {config.client_ca_file!r} holds no PEM CA certificate: "
                             f"{error}") from None
    return TlsCredentials(Path(config.cert_file).read_bytes(), Path(config.key_file).read_bytes(),
                          None if config.client_ca_file is None else Path(config.client_ca_file).read_bytes())


def grpc_server_credentials(config: TlsConfig) -> grpc.ServerCredentials:
    """Server credentials for grpc; with a client CA, a client certificate signed by it is required."""
    credentials = load_tls(config)
    return grpc.ssl_server_credentials([(credentials.private_key, credentials.certificate_chain)],
                                       root_certificates=credentials.client_ca,
                                       require_client_auth=credentials.client_ca is not None)


def host_port(host: str, port: int) -> str:
    """`host:port` as gRPC targets and URLs spell it: an IPv6 host in brackets ([::1]:50051)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_grpc_port(server: grpc.aio.Server, host: str, port: int, tls: TlsConfig | None) -> int:
    """Listen on host:port, over TLS when `tls` is set; returns the bound port (port 0 picks a
    free one). OSError when the address cannot be bound."""
    address = host_port(host, port)
    try:  # grpc.aio raises RuntimeError where grpc's sync server returned 0
        bound = (server.add_secure_port(address, grpc_server_credentials(tls)) if tls is not None
                 else server.add_insecure_port(address))
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise OSError(f"cannot listen on {address}")
    return bound
