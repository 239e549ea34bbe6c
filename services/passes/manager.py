"""The pass manager: runs named passes in order, records what each changed, checks each contract.

A pass must leave the model's signature alone: the same graph input and output names,
in the same order, with the same dtypes and ranks where they were known. Any exception
or broken contract becomes CONVERSION_FAILED naming the pass and the passes before it.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import onnx_ir as ir

from services.errors import ConversionFailed
from services.passes._base import KilnPass, PassResult, count_nodes

__all__ = ["OptimizeReport", "PassManager", "PassRecord", "graph_signature", "pass_failure"]

TOOL = "kiln passes"


@dataclass
class PassRecord:
    """What one pass did: node counts around it, its time, whether it changed the model."""

    name: str
    nodes_before: int
    nodes_after: int
    seconds: float
    modified: bool
    #: Set by the safety net when this pass changed the outputs and was undone.
    reverted: bool = False
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        body = asdict(self)
        body["seconds"] = round(self.seconds, 4)
        if body["reason"] is None:
            del body["reason"]
        return body


@dataclass
class OptimizeReport:
    """The whole optimisation: per-pass records, node counts, time and the numeric check."""

    passes: list[PassRecord]
    nodes_before: int
    nodes_after: int
    seconds: float
    verification: dict[str, Any] | None = field(default=None)

    @property
    def reverted(self) -> list[str]:
        """Return the names of the passes the safety net undid."""
        return [r.name for r in self.passes if r.reverted]

    def to_dict(self) -> dict[str, Any]:
        return {
            "passes": [r.to_dict() for r in self.passes],
            "nodes_before": self.nodes_before,
            "nodes_after": self.nodes_after,
            "seconds": round(self.seconds, 4),
            "verification": self.verification,
        }


@dataclass(frozen=True)
class _Port:
    name: str
    dtype: ir.DataType | None
    rank: int | None


def _port(value: ir.Value) -> _Port:
    return _Port(value.name or "", value.dtype, value.shape.rank() if value.shape is not None else None)


def graph_signature(model: ir.Model) -> tuple[tuple[_Port, ...], tuple[_Port, ...]]:
    """Return the main graph's (inputs, outputs) as name, dtype and rank."""
    return tuple(_port(v) for v in model.graph.inputs), tuple(_port(v) for v in model.graph.outputs)


def _signature_drift(
    before: tuple[tuple[_Port, ...], tuple[_Port, ...]], after: tuple[tuple[_Port, ...], tuple[_Port, ...]]
) -> str | None:
    """Describe how a signature changed, or None when callers would not notice."""
    for kind, old, new in (("input", before[0], after[0]), ("output", before[1], after[1])):
        if [p.name for p in old] != [p.name for p in new]:
            return f"graph {kind}s changed from {[p.name for p in old]} to {[p.name for p in new]}"
        for o, n in zip(old, new, strict=True):
            if o.dtype is not None and n.dtype != o.dtype:
                return f"graph {kind} {o.name!r} changed dtype {o.dtype} -> {n.dtype}"
            if o.rank is not None and n.rank is not None and n.rank != o.rank:
                return f"graph {kind} {o.name!r} changed rank {o.rank} -> {n.rank}"
    return None


def pass_failure(name: str, before: Sequence[str], exc: BaseException | str) -> ConversionFailed:
    """Return the CONVERSION_FAILED for pass ``name`` failing after the passes ``before``."""
    after = f" after {', '.join(before)}" if before else " (the first pass)"
    if isinstance(exc, BaseException):
        text = f"{type(exc).__name__}: {exc}"
        tail = "".join(traceback.format_exception(exc))[-2000:]
    else:
        text, tail = exc, exc
    return ConversionFailed(
        f"optimisation pass {name!r} failed{after}: {text}",
        hint=f"Set `optimize: false` in the spec to skip Kiln's ONNX passes, and report the model: pass {name!r} is at fault.",
        tool=TOOL,
        output_tail=tail,
        passes_before=list(before),
        **{"pass": name},
    )


class PassManager:
    """Run a fixed list of uniquely named passes over an ``onnx_ir`` model in place."""

    def __init__(self, passes: Sequence[KilnPass]) -> None:
        names: list[str] = []
        for p in passes:
            if not isinstance(p, KilnPass) or not p.name:
                raise TypeError(f"{p!r} is not a named KilnPass")
            if p.name in names:
                raise ValueError(f"pass {p.name!r} appears twice; names identify passes in reports")
            names.append(p.name)
        self.passes = list(passes)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.passes]

    def run(self, model: ir.Model) -> list[PassRecord]:
        """Run every pass on ``model`` (in place); return one record per pass."""
        records: list[PassRecord] = []
        for p in self.passes:
            records.append(self.run_pass(p, model, [r.name for r in records]))
        return records

    def run_pass(self, p: KilnPass, model: ir.Model, before: Sequence[str]) -> PassRecord:
        """Run one pass, check its contract, and return its record; CONVERSION_FAILED names it."""
        signature = graph_signature(model)
        nodes_before = count_nodes(model)
        started = time.perf_counter()
        try:
            result = p(model)
        except Exception as exc:
            raise pass_failure(p.name, before, exc) from exc
        seconds = time.perf_counter() - started
        if not isinstance(result, PassResult) or result.model is not model:
            raise pass_failure(p.name, before, "the pass did not return PassResult(model, modified) for the same model")
        drift = _signature_drift(signature, graph_signature(model))
        if drift is not None:
            raise pass_failure(p.name, before, f"the pass broke its contract: {drift}")
        nodes_after = count_nodes(model)
        # A pass that claims no change but changed the node count is lying; trust the count.
        modified = bool(result.modified) or nodes_after != nodes_before
        return PassRecord(p.name, nodes_before, nodes_after, seconds, modified)
