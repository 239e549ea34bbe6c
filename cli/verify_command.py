"""`kiln verify`: is a published version, on disk or in S3, the one Kiln signed?

Checks the version's ``kiln-signature.sig`` (OpenSSF model-signing, services/repository/signing.py)
against the trusted public keys and every file against the digests it signs. Each verdict has
its own exit status (README, "Verifying a published version"), so a deploy script can tell a
corrupted file from a foreign signature without reading the text.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import click

from cli.common import EXIT_FAILED, EXIT_INPUT, handle_errors, out, print_error

__all__ = ["COMMANDS", "EXIT_CODES", "verify"]

#: The exit status of each verdict; 1, 2 and 3 keep their meaning across `kiln` (failed, bad input, internal).
EXIT_CODES = {
    "VERIFIED": 0,
    "UNSIGNED": 4,
    "SIGNATURE_FOREIGN": 5,
    "SIGNATURE_INVALID": 6,
    "FILE_MISSING": 7,
    "FILE_REPLACED": 8,
    "FILE_MODIFIED": 9,
    "FILE_UNSIGNED": 10,
}


def _fetch(target: str, dest: Path) -> tuple[Path, str]:
    """Return a local directory holding the version ``target`` names, and how to name it in messages."""
    from services.errors import InvalidSpec, NotFound

    if target.startswith("s3://"):
        from services.repository.s3 import S3ModelRepository
        from services.s3 import S3Location
        from services.settings import get_settings
        from services.storage.factory import s3_client_options

        where = S3Location.parse(target.rstrip("/"))
        repo = S3ModelRepository(where.bucket, where.prefix, **s3_client_options(get_settings()))
        local = dest / (where.prefix.rsplit("/", 1)[-1] or where.bucket)
        repo.download_dir("", local)
        return local, target
    if "://" in target:
        raise InvalidSpec(f"{target!r} is neither a directory nor an s3:// URL", hint="Give a version's directory.")
    path = Path(target).expanduser()
    if not path.is_dir():
        raise NotFound(
            f"{path} is not a directory", hint="Give a published version's directory: <repository>/<root>/<name>/<N>."
        )
    return path.resolve(), str(path)


def _read(path: Path, flag: str) -> bytes:
    from services.errors import InvalidSettings

    try:
        return path.expanduser().read_bytes()
    except OSError as exc:
        raise InvalidSettings(f"{flag} {path}: {exc.strerror}", hint="Give the path of a PEM file.") from None


@click.command("verify")
@click.argument("target")
@click.option(
    "--key",
    "keys",
    multiple=True,
    type=click.Path(path_type=Path, dir_okay=False),
    help="A public key (PEM) to trust; repeatable. Default: the public half of this machine's signing key "
    "(KILN_SIGNING_KEY) and KILN_SIGNING_TRUSTED_KEYS.",
)
@click.option(
    "--ca",
    "cas",
    multiple=True,
    type=click.Path(path_type=Path, dir_okay=False),
    help="A CA certificate (PEM) a certificate-signed version must chain to; repeatable. Default: "
    "KILN_SIGNING_TRUSTED_CAS, else the root of KILN_SIGNING_CERTIFICATE_CHAIN.",
)
@click.option(
    "--evaluation",
    "evaluation",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    help="Labelled data (.npz, as `kiln compile --evaluation` takes it): once the signature holds, run the artifact "
    "on its engine and score it with the version's metric against the source's score in its manifest.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the verdict as JSON.")
@handle_errors
def verify(target: str, keys: tuple[Path, ...], cas: tuple[Path, ...], evaluation: Path | None, as_json: bool) -> None:
    """Check that a published version (a directory or s3://bucket/prefix/<root>/<name>/<N>) is the one Kiln signed.

    A signature carrying a certificate (KILN_SIGNING_CERTIFICATE) must chain to a trusted CA (--ca).
    With --evaluation, a verified version's artifact is also run on its engine and scored on the labelled
    data; a drop past the version's max_drop is ACCURACY_DROP_EXCEEDED, exit 1.
    Exit status: 0 verified, 4 unsigned, 5 signed by a key not trusted here, 6 signature invalid,
    7 a signed file is missing, 8 a file was replaced, 9 a file was modified in place, 10 a file
    the signature does not cover; 2 bad input, 3 internal error.
    """
    from services.errors import NotFound
    from services.repository.signing import verify_version
    from services.repository.signing_keys import (
        load_public_key,
        load_trusted_cas,
        signing_key_from_settings,
        trusted_cas,
        trusted_keys,
    )
    from services.settings import get_settings

    trusted = [load_public_key(_read(path, "--key"), str(path)) for path in keys]
    authorities = load_trusted_cas(b"\n".join(_read(path, "--ca") for path in cas), "--ca") if cas else None
    if not (trusted or authorities):
        settings = get_settings()
        own = signing_key_from_settings(settings)
        trusted, authorities = trusted_keys(settings, own), trusted_cas(settings, own)
    with tempfile.TemporaryDirectory(prefix="kiln-verify-") as tmp:
        try:
            version_dir, shown = _fetch(target, Path(tmp))
        except NotFound as exc:  # a wrong path or prefix is bad input here, not a failed check
            print_error(exc.code, exc.message, exc.hint)
            sys.exit(EXIT_INPUT)
        verdict = verify_version(version_dir, trusted, authorities)
        scored = _score(version_dir, evaluation) if evaluation is not None and verdict.verified else None
    status = EXIT_CODES.get(verdict.code, 1)
    if scored is not None and scored.get("error"):
        status = EXIT_FAILED
    body: dict[str, Any] = {"target": shown, "exit_status": status, **verdict.to_dict()}
    if evaluation is not None:
        # Files that are not the ones signed are not scored: whatever they score says nothing of Kiln's artifact.
        body["evaluation"] = scored or {"skipped": "the files are not the ones signed"}
    if as_json:
        out.print_json(json.dumps(body, default=str))
    elif verdict.verified:
        out.print(f"[green]verified[/] {shown}: {verdict.message}", soft_wrap=True, highlight=False)
    else:
        print_error(verdict.code, f"{shown}: {verdict.message}", verdict.hint)
        for problem in verdict.problems if len(verdict.problems) > 1 else []:
            out.print(f"  {problem.code}: {problem.message}", soft_wrap=True, highlight=False)
    if not as_json and evaluation is not None:
        _print_evaluation(body["evaluation"])
    sys.exit(status)


def _score(version_dir: Path, data: Path) -> dict[str, Any]:
    """Return the version's evaluation on ``data``; a failed drop check as the report with its error."""
    from services.errors import AccuracyDropExceeded
    from services.pipeline.evaluate_version import evaluate_version

    try:
        return evaluate_version(version_dir, data)
    except AccuracyDropExceeded as exc:
        return {**exc.details.get("evaluation", {}), "error": exc.to_dict()}


def _print_evaluation(report: dict[str, Any]) -> None:
    if "skipped" in report:
        out.print(f"evaluation skipped: {report['skipped']}", highlight=False)
        return
    recorded = report.get("recorded") or {}
    line = (
        f"{report['metric']} of {report['output']} on {report['samples']} labelled samples ({report.get('engine')}): "
        f"{report['artifact']} now, {recorded.get('artifact')} recorded at publish; source {report['source']}, "
        f"drop {report['drop']} (max_drop {report['max_drop']})"
    )
    if report.get("error"):
        print_error(report["error"]["code"], report["error"]["message"], report["error"]["hint"])
        out.print(f"evaluation: {line}", soft_wrap=True, highlight=False)
    else:
        out.print(f"[green]evaluation passed[/]: {line}", soft_wrap=True, highlight=False)


#: What cli.main registers.
COMMANDS = (verify,)
