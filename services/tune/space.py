"""The search space: which targets and precisions to build, and the speed settings per engine.

Each engine's settings are the knobs its runner takes (services/runners): onnxruntime's
intra-op threads and graph optimisation level; OpenVINO's threads, streams and performance
hint (always with ``INFERENCE_PRECISION_HINT=f32``: on CPUs with AVX512-BF16/AMX the plugin
otherwise runs float graphs in bf16, which is not what parity checked); LiteRT's threads and
whether its default XNNPACK delegate applies; MNN's and ncnn's thread counts (searched only
when asked for: they are not default targets). Targets without a grid here (tvm, tfserving)
are timed at their runner's defaults.
"""

from __future__ import annotations

import os
from typing import Any

from services.descriptors import registry
from services.graph.engines import ENGINES

__all__ = [
    "THREADED_TARGETS",
    "TUNABLE_TARGETS",
    "default_targets",
    "precisions_for",
    "runner_options",
    "settings_grid",
    "thread_counts",
    "triton_serving",
]

#: Targets with a settings grid, in the order they are tried; the default search covers the installed ones.
TUNABLE_TARGETS = ("onnxruntime", "openvino", "tflite")
#: Targets searched only when asked for (``--targets``), whose grid is their runner's thread count.
THREADED_TARGETS = ("mnn", "ncnn")


def _engine_installed(family: str) -> bool:
    return any(e.is_installed() for name, e in ENGINES.items() if name == family or name.startswith(family + "-"))


def default_targets() -> list[str]:
    """Return the CPU targets with a settings grid whose engine is installed here."""
    targets = registry().targets
    return [t for t in TUNABLE_TARGETS if t in targets and _engine_installed(targets[t].engine)]


def precisions_for(target: str, source_format: str, wanted: list[str]) -> list[str]:
    """Return the precisions of ``wanted`` that ``target`` can build from ``source_format`` (all when unrestricted)."""
    d = registry().targets[target]
    # The route may convert the source first (ONNX -> SavedModel for tflite): any accepted format counts.
    allowed: set[str] = set()
    for fmt in d.accepts:
        allowed |= set(d.precisions.get(fmt, {"fp32", "fp16", "int8", "int4"}))
    return [p for p in wanted if p in allowed]


def thread_counts(cpus: int | None = None) -> list[int]:
    """Return the thread counts worth trying: one, and every core (two values at most, to keep the grid small)."""
    n = cpus or os.cpu_count() or 1
    return sorted({1, n})


def settings_grid(target: str, objective: str, cpus: int | None = None) -> list[dict[str, Any]]:
    """Return the speed settings to time ``target``'s artifact under; the first is the engine's default-like one.

    The grid is the same for every ``objective`` today (batch sizes are the throughput dimension).
    """
    threads = thread_counts(cpus)
    most = threads[-1]
    if target == "onnxruntime":
        return [{"threads": t, "optimization": level} for t in reversed(threads) for level in ("all", "basic")]
    if target == "openvino":
        grid: list[dict[str, Any]] = [{"hint": "LATENCY", "threads": t} for t in reversed(threads)]
        # THROUGHPUT splits the cores into streams; a single synchronous request uses one of them.
        grid.append({"hint": "THROUGHPUT", "streams": most, "threads": most})
        return grid
    if target == "tflite":
        return [{"threads": t, "xnnpack": x} for t in reversed(threads) for x in (True, False)]
    if target in THREADED_TARGETS:
        return [{"threads": t} for t in reversed(threads)]
    return [{}]


def runner_options(target: str, settings: dict[str, Any]) -> dict[str, Any]:
    """Return the keyword options that open ``target``'s runner under ``settings``."""
    if target == "onnxruntime":
        return {"threads": settings.get("threads"), "optimization": settings.get("optimization")}
    if target == "openvino":
        return {
            "inference_precision": "f32",
            "threads": settings.get("threads"),
            "performance_hint": settings.get("hint"),
            "streams": settings.get("streams"),
        }
    if target == "tflite":
        return {"threads": settings.get("threads"), "xnnpack": settings.get("xnnpack", True)}
    return dict(settings)


def triton_serving(target: str, settings: dict[str, Any], batch: int, instances: int) -> dict[str, Any]:
    """Return the spec's ``serving.triton`` that serves ``target`` as measured: these settings, instances, batch.

    The engine settings map onto the same knobs the runner took (services/runners), so the
    published config.pbtxt runs the artifact as it was timed.
    """
    out: dict[str, Any] = {"instance_count": instances}
    # Kiln publishes OpenVINO with Triton's batching off (services/exporters/openvino.py): clients
    # send the measured batch themselves, there is no dynamic batcher to prefer it.
    if batch > 1 and target != "openvino":
        out["preferred_batch_sizes"] = [batch]
    if target == "onnxruntime":
        out["threads"] = settings.get("threads")
        out["onnxruntime_optimization"] = settings.get("optimization")
    elif target == "openvino":
        out["threads"] = settings.get("threads")
        out["openvino_streams"] = settings.get("streams")
        out["openvino_hint"] = settings.get("hint")
    return {k: v for k, v in out.items() if v is not None}
