"""The compose service and Helm values an engine's worker needs, derived from its descriptor.

``compose.yaml`` and ``helm/kiln/values.yaml`` stay hand-written (anchors, comments, per-engine
resources), and tests/test_deploy_checks.py holds them to what this module derives; when an
engine is missing, the test prints the blocks to paste, which is also what

    python -m services.deploy_snippets tvm

prints for an engine called ``tvm``.
"""

from __future__ import annotations

import sys
from typing import Any

import yaml

from services.descriptors import EngineDescriptor, concrete_engines, registry

__all__ = ["compose_worker", "helm_worker", "snippets"]


def compose_worker(name: str) -> dict[str, Any]:
    """Return what compose.yaml's ``worker-<name>`` service must say (as ``docker compose config`` prints it)."""
    engine = concrete_engines()[name]
    image = engine.image
    build: dict[str, Any] = {"context": ".", "dockerfile": image.dockerfile}
    if image.build_target:
        build["target"] = image.build_target
    if engine.variants:
        build["args"] = {}  # per-variant build arguments are the image's own (docker/<engine>.Dockerfile)
    else:
        build["args"] = {
            "BASE_IMAGE": "${KILN_BASE_IMAGE:-python:3.11-slim-bookworm}",
            "ENGINE": name,
            "EXTRAS": ",".join(image.extras),
        }
    service: dict[str, Any] = {
        "<<": "*tensorrt-worker" if image.gpus else "*cpu-worker",
        "image": f"${{KILN_IMAGE_PREFIX:-kiln}}/worker-{name}:${{KILN_IMAGE_TAG:-latest}}",
        "build": build,
    }
    if image.gpus:
        variant = name.removeprefix(f"{engine.name}-")
        service["profiles"] = ["gpu", f"gpu-{variant}"] if engine.variants else ["gpu"]
    return service


def helm_worker(name: str) -> dict[str, Any]:
    """Return the chart's ``workers.<name>`` values: a GPU engine is off by default and asks for its GPUs."""
    gpus = concrete_engines()[name].image.gpus
    values: dict[str, Any] = {
        "enabled": gpus == 0,
        "replicas": 1,
        "concurrency": 1,
        "image": {"repository": "", "tag": ""},
        "gpus": gpus,
        "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "8Gi"}},
        "nodeSelector": {"nvidia.com/gpu.present": "true"} if gpus else {},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}] if gpus else [],
        "affinity": {},
        "podAnnotations": {},
        "terminationGracePeriodSeconds": 600,
        "autoscaling": {"minReplicas": 0 if gpus else 1, "maxReplicas": 4, "listLength": 4},
    }
    return values


def _engine(family: str) -> EngineDescriptor:
    try:
        return registry().engines[family]
    except KeyError:
        raise SystemExit(f"no engine {family!r}; known: {', '.join(registry().engines)}") from None


def snippets(family: str) -> str:
    """Return the YAML to paste into compose.yaml, values.yaml and values.schema.json for engine ``family``."""
    engine = _engine(family)
    names = engine.concrete()
    compose = yaml.safe_dump({f"worker-{n}": compose_worker(n) for n in names}, sort_keys=False)
    compose = compose.replace("'<<': '*tensorrt-worker'", "<<: *tensorrt-worker").replace(
        "'<<': '*cpu-worker'", "<<: *cpu-worker"
    )
    helm = yaml.safe_dump({n: helm_worker(n) for n in names}, sort_keys=False, default_flow_style=None)
    return (
        f"# compose.yaml, under services:\n{_indent(compose, 2)}\n"
        f"# helm/kiln/values.yaml, under workers: (size resources for the engine)\n{_indent(helm, 2)}\n"
        f"# helm/kiln/values.schema.json: add {', '.join(repr(n) for n in names)} to "
        "properties.workers.propertyNames.enum\n"
    )


def _indent(text: str, n: int) -> str:
    return "".join(" " * n + line if line.strip() else line for line in text.splitlines(keepends=True))


if __name__ == "__main__":
    for arg in sys.argv[1:] or list(registry().engines):
        print(snippets(arg))
