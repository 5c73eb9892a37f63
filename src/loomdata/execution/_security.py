"""TLS credentials for loomdata's Dask clusters: a private CA and certificates, made with `cryptography`.

Every cluster loomdata starts uses TLS with mutual authentication (`distributed.Security`, with
`require_encryption`): scheduler, workers and clients each present a certificate signed by the
cluster's CA and accept only peers that do (Dask checks the chain, not host names). The embedded
cluster makes a fresh CA per start, signs one certificate for its scheduler, workers and clients,
and forgets the CA key, so nobody can sign another; the files go into a 0700 folder, keys 0600,
so only the owning user can connect. `make_certs` writes a CA and separate scheduler, worker and
client certificates for a multi-host deployment (`loom certs DIR`).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loomdata.execution.protocol import TlsInfo
from loomdata.schemas.errors import ExecutionError

if TYPE_CHECKING:  # imported where used: a child interpreter making certificates loads no Dask (`_cluster`)
    from distributed.security import Security

__all__ = [
    "EMBEDDED_DAYS",
    "ENV_CA",
    "ENV_CERT",
    "ENV_INSECURE",
    "ENV_KEY",
    "TLS_DIR",
    "CertFiles",
    "TlsFiles",
    "embedded_tls",
    "make_certs",
    "security_of",
    "user_tls",
]

TLS_DIR = ".loom-tls"
"""The folder (inside a plan dir or workdir) where an embedded cluster keeps its credentials."""
EMBEDDED_DAYS = 30  # an embedded cluster's CA and certificate: valid this long from its start (new at each start)
DEPLOY_DAYS = 365  # `loom certs`
ENV_CA, ENV_CERT, ENV_KEY = "LOOM_TLS_CA_FILE", "LOOM_TLS_CERT", "LOOM_TLS_KEY"
ENV_INSECURE = "LOOM_INSECURE"


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """A CA certificate and one party's certificate and key: PEM file paths, or PEM text held in memory."""

    ca_file: str
    cert: str
    key: str

    @property
    def on_disk(self) -> bool:
        return not any("\n" in v for v in (self.ca_file, self.cert, self.key))

    def info(self) -> TlsInfo | None:
        """What serve.json names for clients (paths only; None when the credentials live in memory)."""
        return TlsInfo(ca_file=self.ca_file, cert=self.cert, key=self.key) if self.on_disk else None


@dataclass(frozen=True, slots=True)
class CertFiles:
    """What `make_certs` wrote: the CA and each role's certificate and key."""

    folder: Path
    ca_file: Path
    roles: dict[str, tuple[Path, Path]]  # role -> (cert, key)


def security_of(files: TlsFiles) -> Security:
    """A `distributed.Security` with TLS required, the same credentials for every role."""
    from distributed.security import Security

    return Security(
        require_encryption=True,
        tls_ca_file=files.ca_file,
        tls_client_cert=files.cert,
        tls_client_key=files.key,
        tls_scheduler_cert=files.cert,
        tls_scheduler_key=files.key,
        tls_worker_cert=files.cert,
        tls_worker_key=files.key,
    )


def user_tls(ca_file: str | None, cert: str | None, key: str | None) -> TlsFiles | None:
    """A user's own credentials (`--tls-*` flags, else LOOM_TLS_* variables); None when none are given.

    ValueError when only some are given or a file is missing.
    """
    got = {
        "--tls-ca-file": ca_file or os.environ.get(ENV_CA),
        "--tls-cert": cert or os.environ.get(ENV_CERT),
        "--tls-key": key or os.environ.get(ENV_KEY),
    }
    if not any(got.values()):
        return None
    missing = [k for k, v in got.items() if not v]
    if missing:
        raise ValueError(
            f"TLS needs a CA file, a certificate and a key; missing {', '.join(missing)} "
            f"(or {ENV_CA}/{ENV_CERT}/{ENV_KEY})"
        )
    for flag, path in got.items():
        if not Path(str(path)).is_file():
            raise ValueError(f"{flag} {path}: no such file")
    return TlsFiles(str(got["--tls-ca-file"]), str(got["--tls-cert"]), str(got["--tls-key"]))


def embedded_tls(folder: Path | None) -> TlsFiles:
    """Fresh credentials for an embedded cluster: files in `folder` (0700, keys 0600) or, without one, in memory.

    The CA key is discarded once the certificate is signed.
    """
    ca_key, ca_cert = _new_ca("loomdata embedded CA", EMBEDDED_DAYS)
    key, cert = _new_leaf("loomdata", ca_key, ca_cert, _local_names(), EMBEDDED_DAYS)
    ca_pem, cert_pem, key_pem = _pem_cert(ca_cert), _pem_cert(cert), _pem_key(key)
    if folder is None:
        return TlsFiles(ca_pem, cert_pem, key_pem)
    _private_dir(folder)
    paths = folder / "ca.pem", folder / "cert.pem", folder / "key.pem"
    for path, text in zip(paths, (ca_pem, cert_pem, key_pem), strict=True):
        _write_private(path, text)
    return TlsFiles(*(str(p) for p in paths))


def make_certs(folder: Path, hosts: list[str], *, days: int = DEPLOY_DAYS) -> CertFiles:
    """A CA (its key kept in `folder`, to sign more later) and scheduler, worker and client certificates.

    `hosts` go into the certificates' subject alternative names (Dask does not check them, other
    TLS tools may). Refuses to overwrite an existing CA.
    """
    _private_dir(folder)
    if (folder / "ca.pem").exists():
        raise ExecutionError(f"{folder / 'ca.pem'} exists; choose an empty folder (a new CA invalidates the old one)")
    ca_key, ca_cert = _new_ca("loomdata CA", days)
    _write_private(folder / "ca-key.pem", _pem_key(ca_key))
    _write_private(folder / "ca.pem", _pem_cert(ca_cert))
    names = sorted({*hosts, *_local_names()})
    roles: dict[str, tuple[Path, Path]] = {}
    for role in ("scheduler", "worker", "client"):
        key, cert = _new_leaf(f"loomdata {role}", ca_key, ca_cert, names, days)
        paths = folder / f"{role}.pem", folder / f"{role}-key.pem"
        _write_private(paths[0], _pem_cert(cert))
        _write_private(paths[1], _pem_key(key))
        roles[role] = paths
    return CertFiles(folder=folder, ca_file=folder / "ca.pem", roles=roles)


# ---- files --------------------------------------------------------------------------------------


def _private_dir(folder: Path) -> None:
    """Create `folder` readable by its owner only (an existing one is narrowed to 0700)."""
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(folder, 0o700)
    except OSError as e:
        raise ExecutionError(f"cannot create the TLS folder {folder}: {e.strerror or e}") from None


def _write_private(path: Path, text: str) -> None:
    """Write `text` to `path` with mode 0600, atomically (a reader never sees half a key)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


# ---- certificates -------------------------------------------------------------------------------


def _crypto() -> Any:
    try:
        from cryptography import x509
    except ImportError:  # pragma: no cover - a dependency of loomdata
        raise ExecutionError(
            "TLS certificates need the `cryptography` package (a loomdata dependency): pip install cryptography"
        ) from None
    return x509


def _local_names() -> list[str]:
    return ["localhost", "127.0.0.1", socket.gethostname()]


def _validity(days: int) -> tuple[dt.datetime, dt.datetime]:
    now = dt.datetime.now(dt.timezone.utc)
    return now - dt.timedelta(minutes=5), now + dt.timedelta(days=days)


def _new_key() -> Any:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _new_ca(name: str, days: int) -> tuple[Any, Any]:
    x509 = _crypto()
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    key = _new_key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    start, end = _validity(days)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _new_leaf(name: str, ca_key: Any, ca_cert: Any, hosts: list[str], days: int) -> tuple[Any, Any]:
    """A certificate for both ends of a connection (server and client auth), signed by the CA."""
    x509 = _crypto()
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = _new_key()
    alt: list[Any] = []
    for h in dict.fromkeys(hosts):
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            alt.append(x509.DNSName(h))
    start, end = _validity(days)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def _pem_cert(cert: Any) -> str:
    from cryptography.hazmat.primitives import serialization

    return str(cert.public_bytes(serialization.Encoding.PEM).decode())


def _pem_key(key: Any) -> str:
    from cryptography.hazmat.primitives import serialization

    return str(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ).decode()
    )
