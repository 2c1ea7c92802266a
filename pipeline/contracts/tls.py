"""TLS on every door that leaves a host (docs/secure.md, "Ports, keys and hostile input").

One certificate and key per machine serve every rollwise server on it (the supervisor's metrics, admin
and Flight endpoints, the learner's weight server, the embedded engine and the fetch agent, the
OpenAI-compatible endpoint), and one CA bundle is what every client trusts (the supervisor calling
engines, fetchers and the learner; fetchers calling the admin endpoint; the learner reading Flight).
Hostnames are verified: a certificate names the addresses its machine is reached by (subjectAltName).

The rule: a server bound beyond loopback serves TLS, and a client sends nothing to another host in
clear (`http://`, `grpc://`) - keys travel in every request's Authorization header - unless the operator
said so explicitly (`tls.allow_plaintext`, `--allow-plaintext`: a private network, a TLS proxy in front).
`PlaintextRefused` carries the one line naming the setting.

Import-light: the standard library (ssl) and nothing of rollwise.
"""

from __future__ import annotations

import ipaddress
import os
import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

PLAIN_SCHEMES = ("http", "grpc", "grpc+tcp")
TLS_SCHEMES = ("https", "grpc+tls")


class PlaintextRefused(ValueError):
    """Plain HTTP or gRPC beyond loopback without `allow_plaintext`; the message names the setting."""


class TlsFileError(ValueError):
    """A certificate, key or CA file that is missing, unreadable or not what it should be."""


@dataclass(frozen=True)
class TlsFiles:
    """Paths as one machine sees them. `cert_file` + `key_file`: its servers speak TLS; `ca_file`: what
    its clients trust (None: the system's default trust store)."""

    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None

    @property
    def serves(self) -> bool:
        return self.cert_file is not None and self.key_file is not None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _readable(path: str, key: str) -> None:
    if not os.path.exists(path):
        raise TlsFileError(f"{key}: {path} does not exist")
    if not os.path.isfile(path):
        raise TlsFileError(f"{key}: {path} is not a file")
    try:
        with open(path, "rb") as handle:
            handle.read(1)
    except OSError as exc:
        raise TlsFileError(f"{key}: {path} cannot be read ({exc.strerror})") from None


def check_files(files: TlsFiles, prefix: str) -> None:
    """Every named file exists, is readable and holds what it should (the key matches the certificate,
    the CA file holds certificates). TlsFileError naming `prefix.cert_file` etc. otherwise."""
    if (files.cert_file is None) != (files.key_file is None):
        raise TlsFileError(f"{prefix}.cert_file and {prefix}.key_file are set together or not at all")
    for name in ("cert_file", "key_file", "ca_file"):
        path = getattr(files, name)
        if path is not None:
            _readable(path, f"{prefix}.{name}")
    if files.serves:
        assert files.cert_file is not None and files.key_file is not None
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                files.cert_file, files.key_file
            )
        except ssl.SSLError as exc:
            raise TlsFileError(
                f"{prefix}.cert_file / {prefix}.key_file: {files.cert_file} and {files.key_file} are not a "
                f"PEM certificate and its private key ({exc.reason or exc})"
            ) from None
    if files.ca_file is not None:
        try:
            ssl.create_default_context(cafile=files.ca_file)
        except ssl.SSLError as exc:
            raise TlsFileError(
                f"{prefix}.ca_file: {files.ca_file} is not a PEM certificate bundle ({exc.reason or exc})"
            ) from None


def server_context(files: TlsFiles) -> ssl.SSLContext | None:
    """The SSLContext of a server on this machine; None without a certificate (plain)."""
    if not files.serves:
        return None
    assert files.cert_file is not None and files.key_file is not None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(files.cert_file, files.key_file)
    return context


def client_context(files: TlsFiles) -> ssl.SSLContext:
    """What a client on this machine trusts: `ca_file`, or the system's store. Hostnames are checked."""
    context = ssl.create_default_context(cafile=files.ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def pem_pair(files: TlsFiles) -> tuple[bytes, bytes]:
    """(certificate, key) PEM bytes, for gRPC, which takes bytes, not paths."""
    assert files.cert_file is not None and files.key_file is not None
    with open(files.cert_file, "rb") as cert, open(files.key_file, "rb") as key:
        return cert.read(), key.read()


def ca_bytes(files: TlsFiles) -> bytes | None:
    """The CA bundle's PEM bytes (gRPC takes them, not a path); None without one."""
    if files.ca_file is None:
        return None
    with open(files.ca_file, "rb") as handle:
        return handle.read()


def require_tls_off_loopback(what: str, host: str, serves_tls: bool, allow_plaintext: bool, how: str) -> None:
    """PlaintextRefused when a server would listen beyond loopback in clear (`how` names the settings)."""
    if serves_tls or allow_plaintext or _is_loopback(host):
        return
    raise PlaintextRefused(
        f"{what} would listen on {host!r}, beyond loopback, in plain text: its API key and everything it "
        f"serves would cross the network in clear. Give it a certificate ({how}), bind 127.0.0.1, or "
        "allow plain text explicitly (tls.allow_plaintext = true, --allow-plaintext)"
    )


def check_url(url: str, what: str, allow_plaintext: bool) -> None:
    """PlaintextRefused for an http:// or grpc:// URL to another host (`what` names its setting)."""
    parts = urlsplit(url)
    if parts.scheme not in PLAIN_SCHEMES or allow_plaintext or _is_loopback(parts.hostname or ""):
        return
    secure = "https" if parts.scheme == "http" else "grpc+tls"
    raise PlaintextRefused(
        f"{what} = {url!r} is plain text to another host: keys and data would cross the network in clear. "
        f"Use {secure}:// (with tls.ca_file trusting its certificate), or allow plain text explicitly "
        "(tls.allow_plaintext = true)"
    )


def context_for(host: str, files: TlsFiles) -> ssl.SSLContext | None:
    """The server context of a server bound to `host`: TLS beyond loopback when this machine has a
    certificate; plain on loopback (nothing leaves the host, and the certificate need not name it)."""
    return None if _is_loopback(host) else server_context(files)


def scheme_of(host: str, files: TlsFiles) -> str:
    """ "https" for a server `context_for` gives a context, else "http"."""
    return "http" if _is_loopback(host) or not files.serves else "https"
