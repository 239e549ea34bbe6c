"""Atomic publishing of a version with its configs and provenance manifest."""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from services.artifacts import DESCRIPTOR, Artifact
from services.errors import NotFound, RepositoryConflict
from services.repository.base import ModelRepository
from services.repository.layouts import (
    OVMS_CONFIG,
    ROOTS,
    TFSERVING_CONFIG,
    ServedModel,
    ovms_config_json,
    server_root,
    tfserving_models_config,
)
from services.repository.signing import SIGNATURE, file_sizes, sign_version
from services.repository.triton_config import (
    DEFAULT_MAX_BATCH_SIZE,
    TritonModel,
    batch_axis_is_dynamic,
    engine_parameters,
    preferred_batch_sizes,
    triton_config_pbtxt,
)
from services.spec import TritonServingSpec
from services.tensors import TensorSpec

__all__ = [
    "MANIFEST",
    "MODEL_META",
    "REPOSITORY_META",
    "PublishedVersion",
    "RepositoryConflict",
    "configured_serving_root",
    "find_model_dir",
    "normal_serving_root",
    "publish_version",
    "published_models",
    "read_manifest",
    "replace_version_file",
    "resolve_serving_root",
    "triton_max_batch_size",
]

MANIFEST = "kiln-manifest.json"
MODEL_META = "kiln-model.json"
#: Repository-wide settings (the serving root), at the repository's top.
REPOSITORY_META = "kiln-repository.json"
#: How many (job id -> version) records a model's kiln-model.json keeps for rerun detection.
PUBLISHED_BY_KEPT = 1000


@dataclass
class PublishedVersion:
    """Where a version landed."""

    name: str
    version: int
    uri: str
    files: list[str]
    reused: bool = False  # an identical version was already there; nothing was written
    signed_by: str | None = None  # the id of the key that signed it (services/repository/signing_keys.py)

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"name": self.name, "version": self.version, "uri": self.uri, "files": self.files}
        if self.signed_by:
            body["signed_by"] = self.signed_by
        return body


def _identical_version(
    repo: ModelRepository, model_dir: str, versions: list[int], manifest: dict[str, Any]
) -> int | None:
    """Return the newest of ``versions`` whose manifest names the same export artifact, source and spec, if any.

    The export's key is a content address over its inputs, spec and tool versions, so the same
    key means the same files; a manifest without one (an older Kiln) never matches. The spec
    is compared too (all but ``version``): publish-only settings such as the serving root or
    Triton's max_batch_size change the configs a server reads, not the export's key.
    """
    key, source = manifest.get("artifact_key"), (manifest.get("source") or {}).get("sha256")
    if not key:
        return None

    def publish_spec(m: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in (m.get("spec") or {}).items() if k != "version"}

    for version in sorted(versions, reverse=True):
        raw = repo.read_file(f"{model_dir}/{version}/{MANIFEST}")
        if raw is None:
            continue
        prior = json.loads(raw)
        if (
            prior.get("artifact_key") == key
            and (prior.get("source") or {}).get("sha256") == source
            and publish_spec(prior) == publish_spec(manifest)
        ):
            return version
    return None


def find_model_dir(repo: ModelRepository, name: str) -> str | None:
    """Return ``<root>/<name>`` where ``name`` is published, or None (names are unique across roots)."""
    for root in ROOTS:
        if repo.read_file(f"{root}/{name}/{MODEL_META}") is not None:
            return f"{root}/{name}"
    return None


def published_models(repo: ModelRepository) -> list[tuple[str, str]]:
    """Return ``(root, name)`` of every published model, by root then name."""
    return [(root, name) for root in ROOTS for name in repo.model_names(root)]


def normal_serving_root(root: str) -> str:
    """Return ``root`` as it is recorded and compared (no trailing slash, except for ``/`` itself)."""
    return root.rstrip("/") or "/"


def configured_serving_root(repo: ModelRepository) -> str | None:
    """Return the serving root in force: the one recorded in the repository, else its setting (KILN_SERVING_ROOT).

    None means the repository's own location. This is the deployment's: on a service only an
    admin's job may change it (api/submission.py), since it moves every model's base path.
    """
    raw = repo.read_file(REPOSITORY_META)
    if raw is not None:
        recorded = json.loads(raw).get("serving_root")
        if recorded:
            return str(recorded)
    return repo.serving_root or None


def resolve_serving_root(repo: ModelRepository, requested: str | None) -> str | None:
    """Return the path servers see this repository at; a requested one is recorded for later publishes.

    Order: the job's (spec or CLI), then :func:`configured_serving_root`.
    """
    if requested:
        root = normal_serving_root(requested)
        if root != configured_serving_root(repo):
            repo.write_file(REPOSITORY_META, json.dumps({"serving_root": root}, indent=2).encode())
        return root
    return configured_serving_root(repo)


def _base_path(repo: ModelRepository, serving_root: str | None, model_dir: str) -> str:
    if serving_root is None:
        return repo.base_path(model_dir)
    return f"{serving_root.rstrip('/')}/{model_dir}"


def _served_models(repo: ModelRepository, kind: str, serving_root: str | None) -> list[ServedModel]:
    out = []
    for root, name in published_models(repo):
        raw = repo.read_file(f"{root}/{name}/{MODEL_META}")
        if raw is None:
            continue
        served = json.loads(raw).get("serving", {}).get(kind)
        if served:
            plugin = served.get("plugin_config", {}) if isinstance(served, dict) else {}
            base = _base_path(repo, serving_root, f"{root}/{name}")
            out.append(ServedModel(name=name, base_path=base, plugin_config=plugin))
    return out


def triton_max_batch_size(
    triton: dict[str, Any],
    inputs: list[TensorSpec],
    outputs: list[TensorSpec],
    requested: int | None,
    limit: int | None,
) -> int:
    """Return Triton's max_batch_size: 0 unless every tensor's batch axis is open.

    ``requested`` is the spec's (0 turns batching off); unset, the exporter's own bound (a
    TensorRT profile), else the spec's input profiles' smallest ``max[0]`` (``limit``), capped
    at :data:`DEFAULT_MAX_BATCH_SIZE`.
    """
    if triton.get("batching") is False or requested == 0:
        return 0
    if not (batch_axis_is_dynamic(inputs) and batch_axis_is_dynamic(outputs)):
        return 0
    bound = triton.get("max_batch_size")
    if requested is not None:
        return min(requested, bound) if bound else requested
    if bound:
        return int(bound)
    return min(DEFAULT_MAX_BATCH_SIZE, limit) if limit else DEFAULT_MAX_BATCH_SIZE


def _already_published(
    repo: ModelRepository, model_dir: str, prior: dict[str, Any], versions: list[int], job_id: str | None
) -> int | None:
    """Return the version job ``job_id`` already published in ``model_dir``, or None.

    A worker that dies after writing a version but before the job store records it makes
    its step run again; that rerun must find the version, not publish a second one. The
    model's record maps recent jobs to their versions; a version newer than the record's
    ``latest`` was written by a publish that died before updating it, so its manifest is read.
    """
    if not job_id:
        return None
    recorded = prior.get("published_by", {}).get(job_id)
    if recorded in versions:
        return int(recorded)
    for v in versions:
        if v > int(prior.get("latest", 0)):
            body = repo.read_file(f"{model_dir}/{v}/{MANIFEST}")
            if body is not None and json.loads(body).get("job_id") == job_id:
                return v
    return None


def publish_version(
    repo: ModelRepository,
    artifact: Artifact,
    *,
    name: str,
    version: int | None,
    manifest: dict[str, Any],
    max_batch_size: int | None = None,
    batch_limit: int | None = None,
    serving_root: str | None = None,
    instance_kind: str | None = None,
    reuse_identical: bool = False,
    triton_serving: TritonServingSpec | None = None,
) -> PublishedVersion:
    """Publish an export artifact as ``<root>/<name>/<version>/``; return where it landed.

    With ``reuse_identical``, a version of ``name`` that already holds this very artifact
    (same ``artifact_key`` and source in its manifest; with ``version`` given, that version
    only) is returned instead of publishing a duplicate. The CLI and the service both publish
    through here, so recompiling an unchanged model adds no version on either.

    ``root`` is the server's (see :mod:`services.repository.layouts`). Order: version files
    under a temp name then renamed into place; then the model's config.pbtxt (config last, so
    Triton never loads a config without its files); then the root configs (TF Serving
    models.config, OVMS config.json), each replaced atomically.

    ``triton_serving`` (the spec's ``serving.triton``, e.g. from ``kiln tune``) sets the config's
    instance count, preferred batch sizes and the engine parameters its backend accepts.
    """
    meta = artifact.meta
    target = meta["target"]
    serving: dict[str, Any] = meta.get("serving", {})
    job_id = manifest.get("job_id")
    model_dir = f"{server_root(target, serving)}/{name}"
    with repo.lock():
        existing = find_model_dir(repo, name)
        prior: dict[str, Any] = {}
        if existing is not None:
            prior = json.loads(repo.read_file(f"{existing}/{MODEL_META}") or b"{}")
            if prior.get("target") != target:
                raise RepositoryConflict(
                    f"model {name!r} in the repository holds {prior.get('target')} artifacts, not {target}",
                    name=name,
                )
        versions = repo.versions(model_dir)
        done = _already_published(repo, model_dir, prior, versions, job_id)
        if done is None and reuse_identical:
            candidates = versions if version is None else [v for v in versions if v == version]
            same = _identical_version(repo, model_dir, candidates, manifest)
            if same is not None:
                files = sorted(
                    p.relative_to(artifact.root).as_posix()
                    for p in Path(artifact.root).rglob("*")
                    if p.is_file() and p.name not in (DESCRIPTOR, ".kiln-complete")
                )
                return PublishedVersion(
                    name=name,
                    version=same,
                    uri=repo.uri(f"{model_dir}/{same}"),
                    files=sorted([*files, MANIFEST]),
                    reused=True,
                )
        if done is not None:  # a rerun of this job's publish: finish what the first attempt began
            version = done
        elif version is None:
            version = (versions[-1] + 1) if versions else 1
        elif version in versions:
            raise RepositoryConflict(f"model {name!r} already has version {version}", name=name, version=version)
        manifest = {**manifest, "name": name, "version": version, "published_at": datetime.now(UTC).isoformat()}
        signed_by = None
        with tempfile.TemporaryDirectory(prefix="kiln-publish-") as tmp:
            # Named for the model: the signature's subject (informative only) reads "<name>.v<version>".
            staged = Path(tmp) / f"{name}.v{version}"
            shutil.copytree(
                artifact.root, staged, ignore=shutil.ignore_patterns(DESCRIPTOR, ".kiln-complete", SIGNATURE)
            )
            # Each file's size, so that a verifier can tell a file replaced from one altered in place;
            # the file an engine opens, so that `kiln verify --evaluation` can run it again.
            manifest["files"] = file_sizes(staged)
            manifest["entry"] = artifact.entry
            (staged / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str))
            if repo.signing_key is not None:
                # Signed in the staging folder: the signature is one of the version's files and
                # appears with them (a rename here, before the manifest on S3), never after.
                signed_by = sign_version(staged, repo.signing_key)
            files = sorted(p.relative_to(staged).as_posix() for p in staged.rglob("*") if p.is_file())
            if done is None:
                repo.write_version(model_dir, version, staged)
        published_by = {k: v for k, v in prior.get("published_by", {}).items() if k != job_id}
        if job_id:
            published_by[job_id] = version
        model_meta = {
            "target": target,
            "format": meta.get("format"),
            "serving": serving,
            "latest": max(version, int(prior.get("latest", 0))) if done is not None else version,
            "published_by": dict(list(published_by.items())[-PUBLISHED_BY_KEPT:]),
        }
        repo.write_file(f"{model_dir}/{MODEL_META}", json.dumps(model_meta, indent=2).encode())
        triton = serving.get("triton")
        if triton:
            io = meta["io"]
            inputs = [TensorSpec.from_dict(t) for t in io["inputs"]]
            outputs = [TensorSpec.from_dict(t) for t in io["outputs"]]
            batch = triton_max_batch_size(triton, inputs, outputs, max_batch_size, batch_limit)
            tuned = triton_serving or TritonServingSpec()
            preferred = preferred_batch_sizes(meta.get("benchmark") or [], batch)
            if tuned.preferred_batch_sizes is not None and batch > 0:
                if max_batch_size is None:  # a measured size above the default bound raises it (the spec's stays)
                    batch = max(
                        [batch, *(b for b in tuned.preferred_batch_sizes if not batch_limit or b <= batch_limit)]
                    )
                preferred = sorted({b for b in tuned.preferred_batch_sizes if 1 < b <= batch})
            params, graph_level = engine_parameters(
                tuned, platform=triton.get("platform"), backend=triton.get("backend")
            )
            config = triton_config_pbtxt(
                TritonModel(
                    name=name,
                    inputs=inputs,
                    outputs=outputs,
                    platform=triton.get("platform"),
                    backend=triton.get("backend"),
                    max_batch_size=batch,
                    preferred_batch_sizes=preferred,
                    default_model_filename=triton.get("default_model_filename"),
                    instance_kind=instance_kind or triton.get("instance_kind", "KIND_CPU"),
                    parameters={**triton.get("parameters", {}), **params},
                    instance_count=tuned.instance_count or 1,
                    graph_level=graph_level,
                )
            )
            repo.write_file(f"{model_dir}/config.pbtxt", config.encode())
        if serving.get("tfserving") or serving.get("ovms"):
            where = resolve_serving_root(repo, serving_root)
            if serving.get("tfserving"):
                repo.write_file(
                    TFSERVING_CONFIG, tfserving_models_config(_served_models(repo, "tfserving", where)).encode()
                )
            if serving.get("ovms"):
                repo.write_file(OVMS_CONFIG, ovms_config_json(_served_models(repo, "ovms", where)).encode())
    return PublishedVersion(
        name=name, version=version, uri=repo.uri(f"{model_dir}/{version}"), files=files, signed_by=signed_by
    )


def read_manifest(repo: ModelRepository, name: str, version: int) -> dict[str, Any]:
    """Return the provenance manifest of a published version (found in whichever root holds it)."""
    model_dir = find_model_dir(repo, name)
    raw = repo.read_file(f"{model_dir}/{version}/{MANIFEST}") if model_dir else None
    if raw is None:
        raise NotFound(f"no manifest for {name} version {version}")
    return json.loads(raw)  # type: ignore[no-any-return]


def replace_version_file(repo: ModelRepository, version_relpath: str, filename: str, data: bytes) -> None:
    """Replace one file of a published version and sign the version again (it was signed with other bytes).

    For what is added after a version is published (``kiln tune`` records its search in the
    manifest). The file is replaced first, then the signature: between the two writes a verifier
    sees the file as modified, never a stale signature passing new bytes.
    """
    repo.write_file(f"{version_relpath}/{filename}", data)
    if repo.signing_key is None:
        return
    with tempfile.TemporaryDirectory(prefix="kiln-resign-") as tmp:
        staged = Path(tmp) / version_relpath.strip("/").replace("/", ".")
        repo.download_dir(version_relpath, staged)
        (staged / SIGNATURE).unlink(missing_ok=True)
        sign_version(staged, repo.signing_key)
        repo.write_file(f"{version_relpath}/{SIGNATURE}", (staged / SIGNATURE).read_bytes())
