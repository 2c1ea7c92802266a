"""A private certificate authority made with the `openssl` command line, for tests and benches that need
TLS between machines of their own: a CA and certificates for hosts, each naming the addresses it is
reached by (subjectAltName), elliptic-curve keys (fast to make)."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pipeline.contracts.tls import TlsFiles

OPENSSL = shutil.which("openssl")
_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str, cwd: Path) -> None:
    assert OPENSSL is not None
    done = subprocess.run([OPENSSL, *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args[:2])} failed: {done.stderr.strip()}")


@dataclass(frozen=True)
class PrivateCA:
    """`cert` is the CA's certificate (the bundle clients trust)."""

    root: Path
    cert: Path
    key: Path

    @staticmethod
    def create(root: Path, name: str = "rollwise-test-ca") -> PrivateCA:
        root.mkdir(parents=True, exist_ok=True)
        _openssl(
            "req", "-x509", *_KEY, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=root,
        )  # fmt: skip
        return PrivateCA(root, root / "ca.pem", root / "ca.key")

    def issue(self, name: str, addresses: list[str]) -> TlsFiles:
        """A certificate for `name` valid for `addresses` (IPs or DNS names) and 127.0.0.1/localhost."""
        sans = [f"IP:{a}" if a.replace(".", "").isdigit() or ":" in a else f"DNS:{a}" for a in addresses]
        sans += ["IP:127.0.0.1", "DNS:localhost"]
        ext = self.root / f"{name}.ext"
        ext.write_text(
            f"subjectAltName={','.join(dict.fromkeys(sans))}\nbasicConstraints=CA:FALSE\n"
            "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\n"
        )
        _openssl(
            "req",
            *_KEY,
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={name}",
            cwd=self.root,
        )
        _openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", ext.name, cwd=self.root,
        )  # fmt: skip
        return TlsFiles(str(self.root / f"{name}.pem"), str(self.root / f"{name}.key"), str(self.cert))
