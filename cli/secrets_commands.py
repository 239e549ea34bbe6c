"""`kiln secrets init`: the deployment's secrets, generated on first start (compose's one-shot).

Writes, into directories that compose keeps in named volumes:

- ``--kiln-dir`` (read by every Kiln process through ``KILN_SECRETS_DIR``, files 0600):
  ``KILN_ADMIN_TOKEN``, ``KILN_SESSION_SECRET``, ``KILN_SIGNING_KEY`` (the EC private key that
  signs every published version), ``KILN_S3_SECRET_ACCESS_KEY`` and ``KILN_DATABASE_URL``;
- ``--postgres-dir``: ``POSTGRES_PASSWORD`` (PostgreSQL's ``POSTGRES_PASSWORD_FILE``);
- ``--s3-dir``: ``MINIO_ROOT_PASSWORD`` (MinIO's ``MINIO_ROOT_PASSWORD_FILE``).

Random values are made once and kept, so a restart changes nothing; a password given in the
environment (``POSTGRES_PASSWORD``, ``MINIO_ROOT_PASSWORD``, ``KILN_S3_SECRET_ACCESS_KEY``)
is taken instead. ``KILN_DATABASE_URL`` is rewritten every start from ``KILN_DATABASE_URL``
when given (an external database), else from ``POSTGRES_USER`` / ``POSTGRES_DB`` and the
password. The admin token is printed once, when it is made; the signing key never is
(``kiln secrets public-key`` prints its public half, what verifiers need).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from urllib.parse import quote

import click

from cli.common import handle_errors

__all__ = ["COMMANDS", "public_key", "secrets_group"]


def _write(path: Path, value: str, mode: int) -> None:
    """Replace ``path`` with ``value`` atomically, created with ``mode`` (never readable by others first)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as f:
        f.write(value)
    os.chmod(tmp, mode)  # the umask may have taken bits away
    tmp.replace(path)


def _kept(path: Path, given: str | None, make: str, mode: int) -> tuple[str, bool]:
    """Return the secret at ``path``: ``given`` if set, else the one kept there, else ``make``; and whether it is new."""
    if given:
        if not path.exists() or path.read_text() != given:
            _write(path, given, mode)
        return given, False
    if path.exists() and path.read_text().strip():
        return path.read_text().strip(), False
    _write(path, make, mode)
    return make, True


def admin_token() -> str:
    """Return a new token in `kiln token create`'s format (``kiln_<id>_<secret>``)."""
    return f"kiln_{secrets.token_hex(4)}_{secrets.token_urlsafe(32)}"


def _signing_key() -> str:
    from services.repository.signing_keys import generate_signing_key

    return generate_signing_key().decode()


@click.group("secrets")
def secrets_group() -> None:
    """The deployment's generated secrets (what compose's secrets-init runs)."""


@secrets_group.command("init")
@click.option("--kiln-dir", type=click.Path(path_type=Path), required=True, help="Kiln's secrets (KILN_SECRETS_DIR).")
@click.option("--postgres-dir", type=click.Path(path_type=Path), help="Where PostgreSQL reads its password.")
@click.option("--s3-dir", type=click.Path(path_type=Path), help="Where the S3 server (MinIO) reads its password.")
@click.option("--postgres-host", default="postgres", show_default=True, help="The database host in KILN_DATABASE_URL.")
@handle_errors
def secrets_init(kiln_dir: Path, postgres_dir: Path | None, s3_dir: Path | None, postgres_host: str) -> None:
    """Make the secrets that are missing; print the admin token once, when it is made."""
    env = os.environ
    for d, mode in ((kiln_dir, 0o700), (postgres_dir, 0o755), (s3_dir, 0o755)):
        if d is not None:
            d.mkdir(parents=True, exist_ok=True)
            os.chmod(d, mode)
    token, made = _kept(kiln_dir / "KILN_ADMIN_TOKEN", None, admin_token(), 0o600)
    _kept(kiln_dir / "KILN_SESSION_SECRET", None, secrets.token_urlsafe(32), 0o600)
    _kept(kiln_dir / "KILN_SIGNING_KEY", env.get("KILN_SIGNING_KEY"), _signing_key(), 0o600)
    s3_given = env.get("MINIO_ROOT_PASSWORD") or env.get("KILN_S3_SECRET_ACCESS_KEY")
    s3_secret, _ = _kept(kiln_dir / "KILN_S3_SECRET_ACCESS_KEY", s3_given, secrets.token_urlsafe(24), 0o600)
    if s3_dir is not None:
        # Readable by the S3 server's own user; the volume is mounted in that container alone.
        _kept(s3_dir / "MINIO_ROOT_PASSWORD", s3_secret, s3_secret, 0o644)
    pg_password, _ = _kept(
        (postgres_dir or kiln_dir) / "POSTGRES_PASSWORD",
        env.get("POSTGRES_PASSWORD"),
        secrets.token_urlsafe(24),
        0o644 if postgres_dir is not None else 0o600,
    )
    url = env.get("KILN_DATABASE_URL") or (
        f"postgresql+psycopg://{quote(env.get('POSTGRES_USER') or 'kiln', safe='')}:{quote(pg_password, safe='')}"
        f"@{postgres_host}:5432/{quote(env.get('POSTGRES_DB') or 'kiln', safe='')}"
    )
    _write(kiln_dir / "KILN_DATABASE_URL", url, 0o600)
    if made:
        click.echo(f"Kiln admin token (shown this once; kept in {kiln_dir / 'KILN_ADMIN_TOKEN'}): {token}")
        click.echo("Make per-team tokens with: kiln token create NAME --tenant TEAM --scope write")
    else:
        click.echo("Kiln secrets present; the admin token is the one shown at first start.")


@secrets_group.command("public-key")
@handle_errors
def public_key() -> None:
    """Print the public half of the signing key (KILN_SIGNING_KEY) in PEM, for `kiln verify --key`."""
    from services.repository.signing_keys import signing_key_from_settings
    from services.settings import get_settings

    key = signing_key_from_settings(get_settings())
    click.echo(key.public.pem.decode(), nl=False)
    click.echo(f"# key id {key.key_id} ({key.source})", err=True)


#: What cli.main registers.
COMMANDS = (secrets_group,)
