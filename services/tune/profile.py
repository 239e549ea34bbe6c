"""Per-layer profiles of a candidate: onnxruntime's profiler and OpenVINO's per-node counters.

Both are run on the candidate's own artifact under its own settings, on the same seeded feeds
the measurement used. Top operators are by total time per run; OpenVINO also says which kernel
and precision each node actually ran in (``exec_type``: e.g. ``brgconv_avx512_I8``), which is
how one sees an int8 artifact running some layers in f32.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from services.benchmark import feeds_for_batch
from services.spec import CompileSpec
from services.tune.measure import open_candidate
from services.tune.report import Candidate

__all__ = ["PROFILED_TARGETS", "exec_precision", "profile_candidate", "summarize_ops"]

PROFILED_TARGETS = ("onnxruntime", "openvino")
TOP = 10

_PRECISIONS = {"fp32": "f32", "f32": "f32", "fp16": "f16", "f16": "f16", "bf16": "bf16", "i8": "i8", "u8": "u8"}


def exec_precision(exec_type: str) -> str | None:
    """Return the precision in an OpenVINO ``exec_type`` (``jit_avx512_FP32`` -> ``f32``), None when it names none."""
    for token in reversed(re.split(r"[_\s]+", exec_type.lower())):
        if token in _PRECISIONS:
            return _PRECISIONS[token]
    return None


def summarize_ops(nodes: list[dict[str, Any]], runs: int) -> dict[str, Any]:
    """Return the top operator types and nodes by time per run from per-node rows (``op_type``, ``node``, ``us``)."""
    by_op: dict[str, float] = defaultdict(float)
    count: dict[str, set[str]] = defaultdict(set)
    by_node: dict[str, dict[str, Any]] = {}
    for n in nodes:
        by_op[n["op_type"]] += n["us"]
        count[n["op_type"]].add(n["node"])
        row = by_node.setdefault(n["node"], {**{k: v for k, v in n.items() if k != "us"}, "us": 0.0})
        row["us"] += n["us"]
    total = sum(by_op.values()) or 1.0
    ops = [
        {"op_type": op, "ms_per_run": us / runs / 1e3, "share": us / total, "nodes": len(count[op])}
        for op, us in sorted(by_op.items(), key=lambda kv: -kv[1])
    ]
    top_nodes = sorted(by_node.values(), key=lambda r: -r["us"])[:TOP]
    for r in top_nodes:
        r["ms_per_run"] = r.pop("us") / runs / 1e3
    return {"total_ms_per_run": total / runs / 1e3, "top_ops": ops[:TOP], "top_nodes": top_nodes}


def _onnxruntime_nodes(c: Candidate, fmt: str, spec: CompileSpec, runs: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="kiln-ort-profile-") as tmp:
        runner = open_candidate(c, fmt, profile_prefix=str(Path(tmp) / "ort"))
        try:
            feeds = feeds_for_batch(runner, spec, c.batch)
            assert feeds is not None
            runner.run(feeds)  # the first run allocates; profiled, but the same for every candidate
            for _ in range(runs):
                runner.run(feeds)
            events = json.loads(runner.end_profiling().read_text())  # type: ignore[attr-defined]
        finally:
            runner.close()
    nodes = []
    for e in events:
        if e.get("cat") != "Node" or not str(e.get("name", "")).endswith("_kernel_time"):
            continue
        args = e.get("args", {})
        nodes.append(
            {
                "node": e["name"].removesuffix("_kernel_time"),
                "op_type": args.get("op_name", "?"),
                "provider": args.get("provider"),
                "us": float(e.get("dur", 0)),
            }
        )
    return nodes


def _openvino_nodes(c: Candidate, fmt: str, spec: CompileSpec, runs: int) -> list[dict[str, Any]]:
    runner = open_candidate(c, fmt, perf_count=True)
    nodes = []
    try:
        feeds = feeds_for_batch(runner, spec, c.batch)
        assert feeds is not None
        runner.run(feeds)
        for _ in range(runs):
            runner.run(feeds)
            # The counters describe the last inference only: read them after each.
            for info in runner.profiling_info():  # type: ignore[attr-defined]
                if str(info.status).endswith("NOT_RUN") or str(info.status).endswith("OPTIMIZED_OUT"):
                    continue
                nodes.append(
                    {
                        "node": info.node_name,
                        "op_type": info.node_type,
                        "exec_type": info.exec_type,
                        "exec_precision": exec_precision(info.exec_type),
                        "us": info.real_time.total_seconds() * 1e6,
                    }
                )
    finally:
        runner.close()
    return nodes


def profile_candidate(c: Candidate, fmt: str, spec: CompileSpec, runs: int = 20) -> dict[str, Any]:
    """Return ``c``'s per-layer profile (top operators and nodes by time per run); ``available`` False elsewhere."""
    base = {"candidate": c.key, "target": c.target, "precision": c.precision, "runs": runs}
    if c.target not in PROFILED_TARGETS or c.artifact is None:
        return {**base, "available": False, "reason": f"no per-layer profiler wired for {c.target}"}
    try:
        if c.target == "onnxruntime":
            nodes = _onnxruntime_nodes(c, fmt, spec, runs)
            source = "onnxruntime SessionOptions.enable_profiling"
        else:
            nodes = _openvino_nodes(c, fmt, spec, runs)
            source = "OpenVINO PERF_COUNT per-node counters"
    except Exception as exc:  # a profiler failing must not lose the recommendation
        return {**base, "available": False, "reason": f"{type(exc).__name__}: {str(exc)[:300]}"}
    summary = summarize_ops(nodes, runs)
    if c.target == "openvino":
        precisions: dict[str, float] = defaultdict(float)
        for n in nodes:
            precisions[n["exec_precision"] or "other"] += n["us"]
        total = sum(precisions.values()) or 1.0
        summary["time_by_exec_precision"] = {k: round(v / total, 4) for k, v in sorted(precisions.items())}
    return {**base, "available": True, "source": source, **summary}
