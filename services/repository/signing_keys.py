"""The key that signs published versions, and the public keys a verifier trusts.

Kiln signs with an elliptic-curve private key (P-256, P-384 or P-521: the curves OpenSSF's
model-signing accepts), given as PEM in ``KILN_SIGNING_KEY`` (the environment, or the file of
that name in ``KILN_SECRETS_DIR`` that ``kiln secrets init`` writes). Without one, outside
production, a development key is made on first use in ``<data_dir>/signing-key.pem`` (0600),
as the dashboard's session key is. A verifier trusts that key's public half and the public
keys listed in ``KILN_SIGNING_TRUSTED_KEYS`` (keys that signed older versions).

Certificates are optional: with ``KILN_SIGNING_CERTIFICATE`` (and its chain), a signature
carries the certificate instead of a key hint, and a verifier checks that the certificate
chains to a CA it trusts (``KILN_SIGNING_TRUSTED_CAS``, ``kiln verify --ca``; by default the
root of the configured chain).

A key is identified by the SHA-256 of its public key's PEM, the same hint model-signing puts
in a signature bundle, so a signature names the key that made it without carrying it. The
private key is never printed, logged or put in an error: messages name where it came from.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from services.errors import InvalidSettings
from services.settings import Environment, Settings

__all__ = [
    "DEV_KEY_FILE",
    "PublicKey",
    "SigningKey",
    "TrustedCAs",
    "certificate_files",
    "generate_signing_key",
    "load_public_key",
    "load_signing_key",
    "load_trusted_cas",
    "signing_key_from_settings",
    "trusted_cas",
    "trusted_keys",
    "with_certificate",
]

#: The development key's file in the data dir (made on first use, outside production only).
DEV_KEY_FILE = "signing-key.pem"
_CURVES = ("secp256r1", "secp384r1", "secp521r1")


def _key_id(public_pem: bytes) -> str:
    return hashlib.sha256(public_pem).hexdigest()


@dataclass(frozen=True)
class PublicKey:
    """A public key a verifier trusts: its PEM and where it came from."""

    pem: bytes = field(repr=False)
    source: str

    @property
    def key_id(self) -> str:
        """Return the SHA-256 of the PEM: what a model-signing bundle names as its key's hint."""
        return _key_id(self.pem)

    @contextmanager
    def as_file(self) -> Iterator[Path]:
        """Yield a file holding the PEM (model-signing reads keys from paths)."""
        with tempfile.TemporaryDirectory(prefix="kiln-pubkey-") as tmp:
            path = Path(tmp) / "key.pub"
            path.write_bytes(self.pem)
            yield path


@dataclass(frozen=True)
class SigningKey:
    """A private signing key. Its PEM never appears in a repr, a message or a log."""

    pem: bytes = field(repr=False)
    source: str  # where it came from ("KILN_SIGNING_KEY", a file's path), for messages
    path: Path | None = None  # the file it was read from, when it was one
    #: An X.509 certificate for the key and the chain to its root (PEM), when signatures carry them.
    certificate: bytes | None = None
    chain: bytes = b""

    @property
    def public(self) -> PublicKey:
        """Return the public half (SubjectPublicKeyInfo PEM)."""
        from cryptography.hazmat.primitives import serialization

        private = serialization.load_pem_private_key(self.pem, password=None)
        pem = private.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        return PublicKey(pem=pem, source=f"the public half of {self.source}")

    @property
    def key_id(self) -> str:
        return self.public.key_id

    @contextmanager
    def as_file(self) -> Iterator[Path]:
        """Yield a file holding the private key: its own file, else one readable by this user alone, removed after."""
        if self.path is not None and self.path.is_file():
            yield self.path
            return
        # TemporaryDirectory is 0700, and the file is created 0600 inside it before anything is written.
        with tempfile.TemporaryDirectory(prefix="kiln-signing-") as tmp:
            path = Path(tmp) / "key.pem"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(self.pem)
            yield path


@dataclass(frozen=True)
class TrustedCAs:
    """CA certificates (PEM) a certificate-signed version must chain to, and where they came from."""

    pem: bytes
    source: str

    @contextmanager
    def as_file(self) -> Iterator[Path]:
        with tempfile.TemporaryDirectory(prefix="kiln-cas-") as tmp:
            path = Path(tmp) / "cas.pem"
            path.write_bytes(self.pem)
            yield path


def _certificates(pem: bytes, source: str) -> list[Any]:
    from cryptography import x509

    try:
        certs = x509.load_pem_x509_certificates(pem.strip() + b"\n")
    except ValueError:
        raise InvalidSettings(f"{source} holds no PEM certificate") from None
    return certs


def with_certificate(key: SigningKey, certificate: str, chain: str) -> SigningKey:
    """Return ``key`` carrying its certificate and chain; INVALID_SETTINGS when the certificate is for another key."""
    from cryptography.hazmat.primitives import serialization

    if not certificate.strip():
        return key
    (leaf, *_) = _certificates(certificate.encode(), "KILN_SIGNING_CERTIFICATE")
    if chain.strip():
        _certificates(chain.encode(), "KILN_SIGNING_CERTIFICATE_CHAIN")
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    if leaf.public_key().public_bytes(serialization.Encoding.PEM, spki) != key.public.pem:
        raise InvalidSettings(
            "KILN_SIGNING_CERTIFICATE is not a certificate for KILN_SIGNING_KEY (their public keys differ)",
            hint="Give the certificate issued for the signing key's public half (`kiln secrets public-key`).",
        )
    return replace(key, certificate=certificate.encode(), chain=chain.encode())


def load_trusted_cas(pem: bytes, source: str) -> TrustedCAs:
    """Return the CA certificates in ``pem``; INVALID_SETTINGS naming ``source`` when it holds none."""
    _certificates(pem, source)
    return TrustedCAs(pem, source)


def trusted_cas(settings: Settings, own: SigningKey | None = None) -> TrustedCAs | None:
    """Return the CAs a certificate-signed version must chain to: KILN_SIGNING_TRUSTED_CAS, else the root of the
    signing key's own chain (or its certificate, self-signed); None when there are none."""
    files = settings.signing_trusted_ca_files
    if files:
        parts = []
        for item in files:
            try:
                parts.append(Path(item).expanduser().read_bytes())
            except OSError as exc:
                raise InvalidSettings(
                    f"KILN_SIGNING_TRUSTED_CAS names {item}, which cannot be read ({exc.strerror})"
                ) from None
        pem = b"\n".join(parts)
        _certificates(pem, "KILN_SIGNING_TRUSTED_CAS")
        return TrustedCAs(pem, "KILN_SIGNING_TRUSTED_CAS")
    if own is not None and own.certificate:
        from cryptography.hazmat.primitives import serialization

        chain = _certificates(own.chain, "KILN_SIGNING_CERTIFICATE_CHAIN") if own.chain.strip() else []
        root = chain[-1] if chain else _certificates(own.certificate, "KILN_SIGNING_CERTIFICATE")[0]
        return TrustedCAs(root.public_bytes(serialization.Encoding.PEM), "the root of KILN_SIGNING_CERTIFICATE_CHAIN")
    return None


@contextmanager
def certificate_files(key: SigningKey) -> Iterator[tuple[Path, list[Path]]]:
    """Yield files holding the key's certificate and its chain (model-signing reads paths)."""
    if key.certificate is None:
        raise InvalidSettings("the signing key has no certificate")
    with tempfile.TemporaryDirectory(prefix="kiln-certs-") as tmp:
        cert = Path(tmp) / "signing.pem"
        cert.write_bytes(key.certificate)
        chain = []
        if key.chain.strip():
            chain.append(Path(tmp) / "chain.pem")
            chain[0].write_bytes(key.chain)
        yield cert, chain


def generate_signing_key() -> bytes:
    """Return a new P-256 private key as unencrypted PKCS#8 PEM."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def load_signing_key(pem: bytes, source: str, path: Path | None = None) -> SigningKey:
    """Return the signing key in ``pem``; INVALID_SETTINGS (naming ``source``, never the key) when it is not one."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    try:
        private = serialization.load_pem_private_key(pem.strip() + b"\n", password=None)
    except (ValueError, TypeError) as exc:
        # Never the exception's text: some parsers quote the input.
        kind = "is encrypted" if isinstance(exc, TypeError) else "is not a PEM private key"
        raise InvalidSettings(
            f"the signing key in {source} {kind}",
            hint="Give an unencrypted EC private key in PEM (P-256, P-384 or P-521); `kiln secrets init` makes one.",
        ) from None
    if not isinstance(private, ec.EllipticCurvePrivateKey) or private.curve.name not in _CURVES:
        raise InvalidSettings(
            f"the signing key in {source} is not an EC key on P-256, P-384 or P-521",
            hint="OpenSSF model-signing signs with those curves only; `kiln secrets init` makes a P-256 key.",
        )
    return SigningKey(pem=pem.strip() + b"\n", source=source, path=path)


def load_public_key(pem: bytes, source: str) -> PublicKey:
    """Return the public key in ``pem``; INVALID_SETTINGS naming ``source`` when it is not one Kiln can verify with."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    if b"PRIVATE KEY" in pem:
        raise InvalidSettings(
            f"{source} holds a private key, not a public one",
            hint="Verify with the public key alone: `kiln secrets public-key` prints it.",
        )
    try:
        public = serialization.load_pem_public_key(pem.strip() + b"\n")
    except ValueError:
        raise InvalidSettings(
            f"{source} is not a PEM public key", hint="`kiln secrets public-key` prints the signing key's public half."
        ) from None
    if not isinstance(public, ec.EllipticCurvePublicKey) or public.curve.name not in _CURVES:
        raise InvalidSettings(f"{source} is not an EC public key on P-256, P-384 or P-521")
    # Re-encoded, so that the key id is the one model-signing computes from the same key.
    canonical = public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return PublicKey(pem=canonical, source=source)


def _dev_key(settings: Settings) -> SigningKey:
    """Return the development key kept in the data dir, made on first use (0600)."""
    path = Path(settings.data_dir) / DEV_KEY_FILE
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written whole under a private name, then linked into place: of two processes making it
        # at once (a worker and the API), one key wins and neither reads a half-written file.
        tmp = path.with_name(f".{DEV_KEY_FILE}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(generate_signing_key())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    return load_signing_key(path.read_bytes(), str(path), path)


def signing_key_from_settings(settings: Settings) -> SigningKey:
    """Return the key that signs this process's publishes: KILN_SIGNING_KEY, else the data dir's development key."""
    given = settings.signing_key.get_secret_value()
    if given.strip():
        key = load_signing_key(given.encode(), "KILN_SIGNING_KEY")
    elif settings.environment is Environment.PRODUCTION:  # the settings refuse this already; never a stray key
        raise InvalidSettings("KILN_SIGNING_KEY must be set in production")
    else:
        key = _dev_key(settings)
    return with_certificate(key, settings.signing_certificate, settings.signing_certificate_chain)


def trusted_keys(settings: Settings, own: SigningKey | None = None) -> list[PublicKey]:
    """Return the public keys a version may be signed with: the signing key's, then KILN_SIGNING_TRUSTED_KEYS'."""
    keys = [(own or signing_key_from_settings(settings)).public]
    for item in settings.signing_trusted_key_files:
        path = Path(item).expanduser()
        try:
            pem = path.read_bytes()
        except OSError as exc:
            raise InvalidSettings(
                f"KILN_SIGNING_TRUSTED_KEYS names {path}, which cannot be read ({exc.strerror})"
            ) from None
        keys.append(load_public_key(pem, str(path)))
    return keys
