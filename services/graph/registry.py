"""The converter graph: every edge format → format, and every target's exporter.

Built from the descriptors (services/descriptors), the one place edges and targets are declared.

Edges and exporters name their implementation as ``"module:function"`` and are imported
only when a step runs, so the planner (and the API, which never imports engine SDKs) can
reason about routes without TensorFlow, torch or OpenVINO installed.

A plan persists each step by a stable name instead (``reference``, ``optimize``, ``publish``,
``convert:<converter>``, ``export:<target>``: names the descriptors register), so renaming or
moving a step function does not break a job already queued. Plans written before step names
persisted the path itself; those still run (:func:`entry_path`, :data:`MOVED_ENTRIES`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from services import descriptors
from services.formats import Format
from services.spec import Precision, TargetName

__all__ = [
    "CHECK_ENTRY",
    "MOVED_ENTRIES",
    "OPTIMIZE_ENTRY",
    "PUBLISH_ENTRY",
    "REFERENCE_ENTRY",
    "Converter",
    "Exporter",
    "Registry",
    "default_registry",
    "entry_path",
    "load_entry",
    "source_engine",
    "step_entry",
    "step_functions",
]

ALL_PRECISIONS = frozenset(Precision)


@dataclass(frozen=True)
class Converter:
    """An edge of the graph: a faithful fp32 conversion from one format to another."""

    name: str
    source: Format
    target: Format
    engine: str  # engine family whose worker runs it: onnxruntime, openvino, tensorflow, tensorrt
    cost: float
    entry: str  # "module:function", called with a StepContext, returns an Artifact
    tool: str  # the library doing the work, for `kiln routes` and the manifest


@dataclass(frozen=True)
class Exporter:
    """The last step of a target: precision, engine-native artifact, parity, benchmark."""

    target: TargetName
    engine: str
    accepts: dict[Format, float]  # input format -> cost of exporting from it
    entry: str
    precisions: dict[Format, frozenset[Precision]] = field(default_factory=dict)  # default: all
    artifact_format: Format | None = None

    def supports(self, fmt: Format, precision: Precision) -> bool:
        """Return True when this exporter can produce ``precision`` from ``fmt``."""
        return fmt in self.accepts and precision in self.precisions.get(fmt, ALL_PRECISIONS)


class Registry:
    """Converters by name and exporters by target; refuses silent overwrites."""

    def __init__(self) -> None:
        self._converters: dict[str, Converter] = {}
        self._exporters: dict[TargetName, Exporter] = {}

    def add_converter(self, conv: Converter, *, replace: bool = False) -> None:
        if conv.name in self._converters and not replace:
            raise ValueError(f"converter {conv.name!r} is already registered")
        self._converters[conv.name] = conv

    def add_exporter(self, exp: Exporter, *, replace: bool = False) -> None:
        if exp.target in self._exporters and not replace:
            raise ValueError(f"exporter for {exp.target.value!r} is already registered")
        self._exporters[exp.target] = exp

    @property
    def converters(self) -> list[Converter]:
        return list(self._converters.values())

    @property
    def exporters(self) -> list[Exporter]:
        return list(self._exporters.values())

    def converter(self, name: str) -> Converter:
        try:
            return self._converters[name]
        except KeyError:
            raise KeyError(f"no converter {name!r}; known: {', '.join(sorted(self._converters))}") from None

    def exporter(self, target: TargetName) -> Exporter:
        try:
            return self._exporters[target]
        except KeyError:
            known = ", ".join(sorted(t.value for t in self._exporters))
            raise KeyError(f"no exporter for {target.value!r}; known: {known}") from None

    def edges_from(self, fmt: Format) -> list[Converter]:
        return [c for c in self._converters.values() if c.source is fmt]

    def engines(self) -> set[str]:
        """Return every engine family some edge or exporter runs on, and the GPU engine that checks GPU-bound targets."""
        engines = {c.engine for c in self._converters.values()} | {e.engine for e in self._exporters.values()}
        targets = descriptors.registry().targets
        if any(t in targets and targets[t].device_bound for t in (e.target.value for e in self._exporters.values())):
            from services.descriptors.gpu import GPU_ENGINE

            engines.add(GPU_ENGINE)
        return engines


def step_functions() -> dict[str, str]:
    """Return every stable step name a plan may persist, with the ``"module:function"`` it runs now."""
    reg = descriptors.registry()
    names = {"reference": REFERENCE_ENTRY, "optimize": OPTIMIZE_ENTRY, "publish": PUBLISH_ENTRY, "check": CHECK_ENTRY}
    names.update({f"convert:{c.name}": c.entry for c in reg.converters.values()})
    names.update({f"export:{t.name}": t.entry for t in reg.targets.values()})
    return names


def step_entry(name: str, entry: str) -> str:
    """Return what a plan persists for a step: its stable ``name`` when that names ``entry``, else ``entry``.

    A registry built in code (a test's, a plugin's) may give a converter or exporter another
    function than its descriptor's: the plan then keeps that function's path.
    """
    return name if step_functions().get(name) == entry else entry


def entry_path(entry: str) -> str:
    """Return the ``"module:function"`` a plan's step ``entry`` runs now.

    ``entry`` is a stable step name, or, in a plan from before step names (or from a registry
    built in code), a path: kept as it is, or mapped to where the function moved.
    """
    path = step_functions().get(entry)
    if path is not None:
        return path
    return MOVED_ENTRIES.get(entry, entry)


def load_entry(entry: str) -> Callable[..., Any]:
    """Import the function a step name or ``"module:function"`` path names (see :func:`entry_path`)."""
    module, _, func = entry_path(entry).partition(":")
    return getattr(importlib.import_module(module), func)  # type: ignore[no-any-return]


def source_engine(fmt: Format) -> str:
    """Return the engine family whose worker reads ``fmt`` (its format descriptor's)."""
    engine = descriptors.registry().formats[fmt.value].source_engine
    if engine is None:
        raise KeyError(f"no engine reads {fmt.value}")
    return engine


REFERENCE_ENTRY = "services.pipeline.reference:run_reference_step"
OPTIMIZE_ENTRY = "services.passes.step:run_optimize_step"
PUBLISH_ENTRY = "services.pipeline.publish:run_publish_step"
#: A GPU-bound artifact's parity and benchmark run again on the GPU worker (services/graph/device_checks.py).
CHECK_ENTRY = "services.exporters.device_check:run_device_check"

#: Step functions that moved, by the path a plan persisted before step names: a job queued then still runs.
#: services/repository/step.py became services/pipeline/publish.py so that the repository sits below
#: the step machinery (docs/architecture.md).
MOVED_ENTRIES: dict[str, str] = {
    "services.repository.step:run_publish_step": PUBLISH_ENTRY,
}


def _converters() -> Iterable[Converter]:
    for c in descriptors.registry().converters.values():
        yield Converter(c.name, Format(c.source), Format(c.target), c.engine, c.cost, c.entry, c.tool)


def _exporters() -> Iterable[Exporter]:
    for t in descriptors.registry().targets.values():
        yield Exporter(
            TargetName(t.name),
            t.engine,
            {Format(f): cost for f, cost in t.accepts.items()},
            t.entry,
            precisions={Format(f): frozenset(Precision(p) for p in ps) for f, ps in t.precisions.items()},
            artifact_format=Format(t.artifact_format),
        )


_DEFAULT: Registry | None = None


def default_registry() -> Registry:
    """Return the process-wide registry of Kiln's real converters and exporters."""
    global _DEFAULT
    if _DEFAULT is None:
        reg = Registry()
        for c in _converters():
            reg.add_converter(c)
        for e in _exporters():
            reg.add_exporter(e)
        _DEFAULT = reg
    return _DEFAULT
