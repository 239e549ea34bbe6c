"""Signed versions: an OpenSSF model-signing signature over every file of a published version.

Signing (:func:`sign_version`, called by ``publish_version`` on the staged version, so the
signature appears with the version, atomically): ``kiln-signature.sig`` is a Sigstore bundle
holding a DSSE envelope whose in-toto statement lists the SHA-256 of every file of the version
but the signature itself, ``kiln-manifest.json`` included, signed with Kiln's EC private key
(:mod:`services.repository.signing_keys`). It is model-signing's own format: ``model_signing
verify key --public_key kiln.pub --signature <dir>/kiln-signature.sig <dir>`` checks it too.

Verifying (:func:`verify_version`) says which of these holds, most serious first:

- ``SIGNATURE_FOREIGN``: signed by a key the verifier does not trust;
- ``SIGNATURE_INVALID``: the signature does not verify with the key it names (the signature
  file or the digests in it were altered), or it is not a signature at all;
- ``UNSIGNED``: no signature (published before Kiln signed, or removed);
- ``FILE_MISSING``, ``FILE_REPLACED`` (another size than the one signed), ``FILE_MODIFIED``
  (the size signed, other bytes: a flipped bit, an edit in place), ``FILE_UNSIGNED`` (a file
  the signature does not cover: an added model file a server would load);
- ``VERIFIED``: the signature is Kiln's and every file is the one signed.

File sizes come from the signed manifest's ``files`` (written at publish); they are believed
only when the manifest itself is the one signed.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from services.repository.signing_keys import PublicKey, SigningKey, TrustedCAs, certificate_files

__all__ = [
    "FILE_CODES",
    "HINTS",
    "SIGNATURE",
    "FileProblem",
    "VersionVerification",
    "file_sizes",
    "sign_version",
    "verify_version",
]

SIGNATURE = "kiln-signature.sig"
MANIFEST = "kiln-manifest.json"  # services.repository.publish.MANIFEST (which imports this module)

VERIFIED = "VERIFIED"
#: Problems with the files, most serious first (a verdict takes the first one found).
FILE_CODES = ("FILE_MISSING", "FILE_REPLACED", "FILE_MODIFIED", "FILE_UNSIGNED")
_RESTORE = (
    "Do not deploy this version: restore its files from a copy you trust, or publish the model again "
    "(resubmit the job, or rerun `kiln compile`)."
)
#: What to do about each verdict: the CLI's hint and the dashboard's.
HINTS = {
    VERIFIED: "",
    "UNSIGNED": "Published before Kiln signed versions, or its signature was removed; publish it again to sign it.",
    "SIGNATURE_FOREIGN": "If that key signed for you (a Kiln key before a rotation), trust its public key with "
    "--key or KILN_SIGNING_TRUSTED_KEYS; otherwise someone else signed these files. " + _RESTORE,
    "SIGNATURE_INVALID": "The signature file, or the digests in it, were altered. " + _RESTORE,
    **dict.fromkeys(FILE_CODES, _RESTORE),
}


@dataclass(frozen=True)
class FileProblem:
    """One file that is not as signed."""

    code: str
    path: str
    message: str


@dataclass
class VersionVerification:
    """What verifying one version found: a code (VERIFIED or the most serious problem), a message, the details."""

    code: str
    message: str
    key_id: str | None = None  # the key the signature names (hint), when there is one
    signed_files: int = 0
    problems: list[FileProblem] = field(default_factory=list)

    @property
    def verified(self) -> bool:
        return self.code == VERIFIED

    @property
    def hint(self) -> str:
        return HINTS.get(self.code, "")

    @property
    def status(self) -> str:
        """Return what the API and dashboard show: verified, unsigned, foreign, invalid or mismatch."""
        return {
            VERIFIED: "verified",
            "UNSIGNED": "unsigned",
            "SIGNATURE_FOREIGN": "foreign",
            "SIGNATURE_INVALID": "invalid",
        }.get(self.code, "mismatch")

    def to_dict(self) -> dict[str, Any]:
        body = asdict(self)
        body["status"] = self.status
        body["hint"] = self.hint
        return body


def _hashing_config() -> Any:
    """Return the hashing both sides use: SHA-256 per file, the signature left out, nothing else ignored."""
    from model_signing import hashing

    return (
        hashing.Config()
        .use_file_serialization(hashing_algorithm="sha256", allow_symlinks=False)
        # git's files are no exception here: a .gitignore added to a version is a file not signed.
        .set_ignored_paths(paths=[SIGNATURE], ignore_git_paths=False)
    )


def file_sizes(version_dir: Path) -> dict[str, dict[str, int]]:
    """Return ``{relpath: {"bytes": n}}`` for the version's files but the manifest and the signature."""
    return {
        p.relative_to(version_dir).as_posix(): {"bytes": p.stat().st_size}
        for p in sorted(version_dir.rglob("*"))
        if p.is_file() and p.relative_to(version_dir).as_posix() not in (MANIFEST, SIGNATURE)
    }


def sign_version(version_dir: Path, key: SigningKey) -> str:
    """Write ``kiln-signature.sig`` over every file of ``version_dir``; return the signing key's id."""
    from model_signing import signing

    (version_dir / SIGNATURE).unlink(missing_ok=True)  # a stale one would only be ignored; never leave it
    config = signing.Config().set_hashing_config(_hashing_config())
    with key.as_file() as path:
        if key.certificate is None:
            config.use_elliptic_key_signer(private_key=path)
        else:
            with certificate_files(key) as (cert, chain):
                config.use_certificate_signer(private_key=path, signing_certificate=cert, certificate_chain=chain)
        config.sign(version_dir, version_dir / SIGNATURE)
    return key.key_id


@dataclass(frozen=True)
class _Bundle:
    """What a signature file says before anything is verified: the key hint or certificate, the statement."""

    hint: str | None
    leaf: Any  # the signing certificate (cryptography x509), when the signature carries one
    statement: dict[str, Any]


def _read_bundle(raw: bytes) -> _Bundle:
    """Return what a model-signing bundle holds; ValueError when it is not one."""
    bundle = json.loads(raw)
    if not isinstance(bundle, dict):
        raise ValueError("not a JSON object")
    material = bundle.get("verificationMaterial") or {}
    hint = (material.get("publicKey") or {}).get("hint")
    leaf = None
    chain = (material.get("x509CertificateChain") or {}).get("certificates") or []
    if chain:
        from cryptography import x509

        leaf = x509.load_der_x509_certificate(base64.b64decode(chain[0]["rawBytes"]))
    payload = (bundle.get("dsseEnvelope") or {}).get("payload")
    if not isinstance(payload, str):
        raise ValueError("no DSSE envelope")
    statement = json.loads(base64.b64decode(payload))
    if not isinstance(statement, dict):
        raise ValueError("the payload is not an in-toto statement")
    return _Bundle(str(hint) if hint else None, leaf, statement)


def _public_key_id(certificate: Any) -> str:
    from cryptography.hazmat.primitives import serialization

    pem = certificate.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(pem).hexdigest()


def _bytes(n: int) -> str:
    return f"{n:,} byte" + ("" if n == 1 else "s")


def _short(key_id: str | None) -> str:
    return (key_id or "?")[:16]


def verify_version(version_dir: Path, keys: Sequence[PublicKey], cas: TrustedCAs | None = None) -> VersionVerification:
    """Return whether ``version_dir`` holds exactly the files a trusted key signed, and if not, what differs.

    A signature that names a key must name one of ``keys``; one that carries a certificate must
    chain to ``cas``.
    """
    sig = version_dir / SIGNATURE
    if not sig.is_file():
        return VersionVerification(
            "UNSIGNED", f"{version_dir.name}: no {SIGNATURE}: nothing says these files are the ones Kiln published"
        )
    try:
        bundle = _read_bundle(sig.read_bytes())
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        return VersionVerification("SIGNATURE_INVALID", f"{SIGNATURE} is not a model-signing bundle ({exc})")
    from cryptography.exceptions import InvalidSignature
    from model_signing import verifying
    from OpenSSL.crypto import X509StoreContextError

    config = verifying.Config().set_hashing_config(_hashing_config())
    with ExitStack() as stack:
        key_id: str | None
        if bundle.leaf is not None:
            key_id = _public_key_id(bundle.leaf)
            signer = f"certificate {bundle.leaf.subject.rfc4514_string() or '(no subject)'}"
            if cas is None:
                return VersionVerification(
                    "SIGNATURE_FOREIGN", f"signed with a {signer}, and no CA is trusted here to check it", key_id
                )
            config.use_certificate_verifier(certificate_chain=[stack.enter_context(cas.as_file())])
        else:
            key_id = bundle.hint
            signer = f"key {_short(key_id)}…"
            trusted = {k.key_id: k for k in keys}
            key = trusted.get(key_id or "")
            if key is None:
                return VersionVerification(
                    "SIGNATURE_FOREIGN",
                    f"signed by another key ({_short(key_id)}…), not by a key trusted here "
                    f"({', '.join(_short(k) + '…' for k in trusted)})",
                    key_id,
                )
            config.use_elliptic_key_verifier(public_key=stack.enter_context(key.as_file()))
        resources = (bundle.statement.get("predicate") or {}).get("resources") or []
        signed = {str(r.get("name")): str(r.get("digest")) for r in resources if isinstance(r, dict)}
        try:
            config.verify(version_dir, sig)
        except X509StoreContextError as exc:
            return VersionVerification(
                "SIGNATURE_FOREIGN",
                f"signed with a {signer} that does not chain to {cas.source if cas else '?'} ({exc})",
                key_id,
            )
        except InvalidSignature:
            return VersionVerification(
                "SIGNATURE_INVALID",
                f"the signature does not verify with the {signer} it names: the signature or the digests in it "
                "were altered",
                key_id,
            )
        except ValueError as exc:
            links = _links(version_dir, signed)
            if links:  # model-signing refuses to hash through a link: each one is a file not signed
                first = min(links, key=lambda p: FILE_CODES.index(p.code))
                return VersionVerification(first.code, first.message, key_id, len(signed), links)
            if not str(exc).startswith("Signature mismatch"):
                return VersionVerification("SIGNATURE_INVALID", f"the signature does not verify: {exc}", key_id)
            # The signature is authentic (checked before the files are hashed): its digests can be trusted.
            problems = _file_problems(version_dir, signed)
            first = min(problems, key=lambda p: FILE_CODES.index(p.code))
            others = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            return VersionVerification(first.code, first.message + others, key_id, len(signed), problems)
    return VersionVerification(VERIFIED, f"{len(signed)} files match the signature of {signer}", key_id, len(signed))


def _links(version_dir: Path, signed: dict[str, str]) -> list[FileProblem]:
    """Return a problem for each symbolic link in the version: a link in place of a signed file replaces it."""
    out = []
    for p in sorted(version_dir.rglob("*")):
        if p.is_symlink():
            rel = p.relative_to(version_dir).as_posix()
            code = "FILE_REPLACED" if rel in signed else "FILE_UNSIGNED"
            out.append(FileProblem(code, rel, f"{rel} is a symbolic link (to {os.readlink(p)}), not the file signed"))
    return out


def _file_problems(version_dir: Path, signed: dict[str, str]) -> list[FileProblem]:
    """Return each file that differs from the signed digests, in path order."""
    actual = {rd.identifier: rd.digest.digest_hex for rd in _hashing_config().hash(version_dir).resource_descriptors()}
    sizes: dict[str, Any] = {}
    if actual.get(MANIFEST) == signed.get(MANIFEST):
        try:
            body = json.loads((version_dir / MANIFEST).read_bytes())
        except ValueError:
            body = {}
        sizes = (body.get("files") if isinstance(body, dict) else None) or {}
    problems = []
    for path in sorted(set(signed) | set(actual)):
        if path not in actual:
            problems.append(FileProblem("FILE_MISSING", path, f"{path} is missing: it was signed, and is gone"))
        elif path not in signed:
            problems.append(
                FileProblem("FILE_UNSIGNED", path, f"{path} is not covered by the signature: it was added since")
            )
        elif actual[path] != signed[path]:
            now = (version_dir / path).stat().st_size
            was = (sizes.get(path) or {}).get("bytes")
            if was is not None and int(was) != now:
                problems.append(
                    FileProblem(
                        "FILE_REPLACED",
                        path,
                        f"{path} was replaced: {_bytes(now)} where {_bytes(int(was))} were signed",
                    )
                )
            elif was is not None:
                problems.append(
                    FileProblem(
                        "FILE_MODIFIED",
                        path,
                        f"{path} was modified in place: same size ({_bytes(now)}), other bytes than the ones signed",
                    )
                )
            else:  # the manifest itself, or any file once the manifest (and so its sizes) cannot be believed
                problems.append(
                    FileProblem("FILE_MODIFIED", path, f"{path} differs from the file signed (its SHA-256 changed)")
                )
    return problems
