"""Development certificates for mutual TLS between lazyserve's services: `lazyserve certs`.

One private CA and one leaf certificate (server and client use) that every service presents.
That is enough to say "only holders of our CA's certificate may talk to the workers"; a
production deployment would give each service its own leaf from its own PKI, and lazyserve
only reads the three PEM paths (LAZYSERVE_TLS_CA, _CERT, _KEY) whichever way they were made.

Written with `cryptography` (the library pip, requests and grpc's own tooling rely on) rather
than by driving the openssl command line, so it works the same wherever Python runs.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# The name every service's certificate carries. Prefill actors advertise whatever IP their Ray
# node has, which no certificate made in advance can list; with LAZYSERVE_TLS_SERVER_NAME set to
# this name, clients check it instead of the address they dialled.
INTERNAL_NAME = "lazyserve.internal"
DEFAULT_HOSTS = ("localhost", "127.0.0.1", INTERNAL_NAME)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _key_usage(*, signing_certs: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=signing_certs,
        crl_sign=signing_certs,
        encipher_only=False,
        decipher_only=False,
    )


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.write_bytes(data)
    if private:
        os.chmod(path, 0o600)


def make_dev_certs(out: Path, hosts: list[str] | tuple[str, ...] = DEFAULT_HOSTS, days: int = 365) -> dict[str, Path]:
    """Writes ca.pem, cert.pem and key.pem (0600) into `out`; returns their paths by role."""
    if not hosts:
        raise ValueError("at least one host name or IP address is needed")
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("lazyserve development CA"))
        .issuer_name(_name("lazyserve development CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(signing_certs=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        x509.CertificateBuilder()
        .subject_name(_name(hosts[0]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(signing_certs=False), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = {"ca": out / "ca.pem", "cert": out / "cert.pem", "key": out / "key.pem"}
    _write(paths["ca"], ca.public_bytes(serialization.Encoding.PEM))
    _write(paths["cert"], leaf.public_bytes(serialization.Encoding.PEM))
    _write(
        paths["key"],
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
        private=True,
    )
    return paths
