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
#: How many (job id -> version) records a model's kiln-model.json keeps for rerun detection.
PUBLISHED_BY_KEPT = 1000


@dataclass
class PublishedVersion:
    """Where a version landed."""

    name: str
    version: int
    uri: str
    files: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "uri": self.uri, "files": self.files}


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


def _already_published(
    repo: ModelRepository, name: str, prior: dict[str, Any], versions: list[int], job_id: str | None
) -> int | None:
    """Return the version job ``job_id`` already published under ``name``, or None.

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
            body = repo.read_file(f"{name}/{v}/{MANIFEST}")
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
    max_batch_size: int = 0,
) -> PublishedVersion:
    """Publish an export artifact as ``<name>/<version>/``; return where it landed.

    Order: version files under a temp name then renamed into place; then the model's
    config.pbtxt (config last, so Triton never loads a config without its files); then the
    root configs (TF Serving models.config, OVMS config.json), each replaced atomically.
    """
    meta = artifact.meta
    target = meta["target"]
    serving: dict[str, Any] = meta.get("serving", {})
    job_id = manifest.get("job_id")
    with repo.lock():
        existing_meta = repo.read_file(f"{name}/{MODEL_META}")
        prior: dict[str, Any] = {}
        if existing_meta is not None:
            prior = json.loads(existing_meta)
            if prior.get("target") != target:
                raise RepositoryConflict(
                    f"model {name!r} in the repository holds {prior.get('target')} artifacts, not {target}",
                    name=name,
                )
        versions = repo.versions(name)
        done = _already_published(repo, name, prior, versions, job_id)
        if done is not None:  # a rerun of this job's publish: finish what the first attempt began
            version = done
        elif version is None:
            version = (versions[-1] + 1) if versions else 1
        elif version in versions:
            raise RepositoryConflict(f"model {name!r} already has version {version}", name=name, version=version)
        manifest = {**manifest, "name": name, "version": version, "published_at": datetime.now(UTC).isoformat()}
        with tempfile.TemporaryDirectory(prefix="kiln-publish-") as tmp:
            staged = Path(tmp) / "v"
            shutil.copytree(artifact.root, staged, ignore=shutil.ignore_patterns(DESCRIPTOR, ".kiln-complete"))
            (staged / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str))
            files = sorted(p.relative_to(staged).as_posix() for p in staged.rglob("*") if p.is_file())
            if done is None:
                repo.write_version(name, version, staged)
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
