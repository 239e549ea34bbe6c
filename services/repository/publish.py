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
from services.repository.layouts import ServedModel, ovms_config_json, tfserving_models_config, triton_config_pbtxt
from services.runners.base import TensorSpec

__all__ = [
    "MANIFEST",
    "MODEL_META",
    "PublishedVersion",
    "RepositoryConflict",
    "publish_version",
    "read_manifest",
]

MANIFEST = "kiln-manifest.json"
MODEL_META = "kiln-model.json"


@dataclass
class PublishedVersion:
    """Where a version landed."""

    name: str
    version: int
    uri: str
    files: list[str]
    reused: bool = False  # an identical version was already there; nothing was written

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "uri": self.uri, "files": self.files}


def _identical_version(repo: ModelRepository, name: str, versions: list[int], manifest: dict[str, Any]) -> int | None:
    """Return the newest of ``versions`` whose manifest names the same export artifact and source, if any.

    The export's key is a content address over its inputs, spec and tool versions, so the same
    key means the same files; a manifest without one (an older Kiln) never matches.
    """
    key, source = manifest.get("artifact_key"), (manifest.get("source") or {}).get("sha256")
    if not key:
        return None
    for version in sorted(versions, reverse=True):
        raw = repo.read_file(f"{name}/{version}/{MANIFEST}")
        if raw is None:
            continue
        prior = json.loads(raw)
        if prior.get("artifact_key") == key and (prior.get("source") or {}).get("sha256") == source:
            return version
    return None


def _served_models(repo: ModelRepository, kind: str) -> list[ServedModel]:
    out = []
    for name in repo.model_names():
        raw = repo.read_file(f"{name}/{MODEL_META}")
        if raw is None:
            continue
        meta = json.loads(raw)
        serving = meta.get("serving", {})
        if serving.get(kind):
            out.append(ServedModel(name=name, base_path=repo.base_path(name), platform="tensorflow"))
    return out


def publish_version(
    repo: ModelRepository,
    artifact: Artifact,
    *,
    name: str,
    version: int | None,
    manifest: dict[str, Any],
    max_batch_size: int = 0,
    reuse_identical: bool = False,
) -> PublishedVersion:
    """Publish an export artifact as ``<name>/<version>/``; return where it landed.

    With ``reuse_identical``, a version of ``name`` that already holds this very artifact
    (same ``artifact_key`` and source in its manifest; with ``version`` given, that version
    only) is returned instead of publishing a duplicate. The CLI and the service both publish
    through here, so recompiling an unchanged model adds no version on either.

    Order: version files under a temp name then renamed into place; then the model's
    config.pbtxt (config last, so Triton never loads a config without its files); then the
    root configs (TF Serving models.config, OVMS config.json), each replaced atomically.
    """
    meta = artifact.meta
    target = meta["target"]
    serving: dict[str, Any] = meta.get("serving", {})
    with repo.lock():
        existing_meta = repo.read_file(f"{name}/{MODEL_META}")
        if existing_meta is not None:
            prior = json.loads(existing_meta)
            if prior.get("target") != target:
                raise RepositoryConflict(
                    f"model {name!r} in the repository holds {prior.get('target')} artifacts, not {target}",
                    name=name,
                )
        versions = repo.versions(name)
        if reuse_identical:
            candidates = versions if version is None else [v for v in versions if v == version]
            same = _identical_version(repo, name, candidates, manifest)
            if same is not None:
                files = sorted(
                    p.relative_to(artifact.root).as_posix()
                    for p in Path(artifact.root).rglob("*")
                    if p.is_file() and p.name not in (DESCRIPTOR, ".kiln-complete")
                )
                return PublishedVersion(
                    name=name,
                    version=same,
                    uri=repo.uri(f"{name}/{same}"),
                    files=sorted([*files, MANIFEST]),
                    reused=True,
                )
        if version is None:
            version = (versions[-1] + 1) if versions else 1
        elif version in versions:
            raise RepositoryConflict(f"model {name!r} already has version {version}", name=name, version=version)
        manifest = {**manifest, "name": name, "version": version, "published_at": datetime.now(UTC).isoformat()}
        with tempfile.TemporaryDirectory(prefix="kiln-publish-") as tmp:
            staged = Path(tmp) / "v"
            shutil.copytree(artifact.root, staged, ignore=shutil.ignore_patterns(DESCRIPTOR, ".kiln-complete"))
            (staged / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str))
            files = sorted(p.relative_to(staged).as_posix() for p in staged.rglob("*") if p.is_file())
            repo.write_version(name, version, staged)
        model_meta = {"target": target, "format": meta.get("format"), "serving": serving, "latest": version}
        repo.write_file(f"{name}/{MODEL_META}", json.dumps(model_meta, indent=2).encode())
        triton = serving.get("triton")
        if triton:
            io = meta["io"]
            config = triton_config_pbtxt(
                name,
                inputs=[TensorSpec.from_dict(t) for t in io["inputs"]],
                outputs=[TensorSpec.from_dict(t) for t in io["outputs"]],
                platform=triton.get("platform"),
                backend=triton.get("backend"),
                max_batch_size=max_batch_size if triton.get("batching", True) else 0,
                default_model_filename=triton.get("default_model_filename"),
                instance_kind=triton.get("instance_kind", "KIND_CPU"),
            )
            repo.write_file(f"{name}/config.pbtxt", config.encode())
        if serving.get("tfserving"):
            repo.write_file("models.config", tfserving_models_config(_served_models(repo, "tfserving")).encode())
        if serving.get("ovms"):
            repo.write_file("config.json", ovms_config_json(_served_models(repo, "ovms")).encode())
    return PublishedVersion(name=name, version=version, uri=repo.uri(f"{name}/{version}"), files=files)


def read_manifest(repo: ModelRepository, name: str, version: int) -> dict[str, Any]:
    """Return the provenance manifest of a published version."""
    raw = repo.read_file(f"{name}/{version}/{MANIFEST}")
    if raw is None:
        raise NotFound(f"no manifest for {name} version {version}")
    return json.loads(raw)  # type: ignore[no-any-return]
