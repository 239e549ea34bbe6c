"""The one place engines, formats, targets and converter edges are registered.

Each module in this package (``services/descriptors/<engine>.py``) declares a module-level
``DESCRIPTORS`` tuple of :class:`EngineDescriptor`, :class:`FormatDescriptor`,
:class:`TargetDescriptor` and :class:`ConverterDescriptor`; so does any module a
distribution names under the ``kiln.descriptors`` entry point group. Everything else is
derived from them: the ``Format`` and ``TargetName`` enums, the engines, queues and
worker preloads, tool versions, runners, the converter graph, the spec's ``options``,
repository roots and the hints that list what Kiln reads. Adding an engine is adding one
module here (plus its exporter, runner and packaging); see docs/adding-an-engine.md.

Descriptor modules import nothing but this package's types and pydantic: they are read
by the API and the planner, which never import engine SDKs.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from importlib import metadata
from typing import Any

from services import errors
from services.descriptors._types import (
    ConverterDescriptor,
    EngineDescriptor,
    FormatDescriptor,
    TargetDescriptor,
    WorkerImage,
)

__all__ = [
    "ConverterDescriptor",
    "EngineDescriptor",
    "FormatDescriptor",
    "Registry",
    "TargetDescriptor",
    "WorkerImage",
    "concrete_engines",
    "engine_family",
    "option_sections",
    "readable_formats_hint",
    "registry",
]

ENTRY_POINT_GROUP = "kiln.descriptors"

#: The historical order of the built-in engines, formats and targets (queues, enum order, JSON
#: Schema order, hints); those registered later follow in discovery order.
_CORE_FORMATS = (
    "onnx",
    "keras",
    "savedmodel",
    "tflite",
    "torchscript",
    "torch_export",
    "openvino_ir",
    "tensorrt_plan",
)
_CORE_TARGETS = ("onnxruntime", "openvino", "tflite", "tfserving", "tensorrt")
#: Engines keep theirs too (queue order): a module named before "onnxruntime" ("mnn") must not lead.
_CORE_ENGINES = ("onnxruntime", "openvino", "tensorflow", "tensorrt")

Descriptor = EngineDescriptor | FormatDescriptor | TargetDescriptor | ConverterDescriptor


@dataclass(frozen=True)
class Registry:
    """Every descriptor, by kind and name, checked for duplicates and dangling references."""

    engines: dict[str, EngineDescriptor]
    formats: dict[str, FormatDescriptor]
    targets: dict[str, TargetDescriptor]
    converters: dict[str, ConverterDescriptor]
    origin: dict[tuple[str, str], str]  # (kind, name) -> module that registered it

    @classmethod
    def build(cls, modules: Iterable[tuple[str, Iterable[Descriptor]]]) -> Registry:
        """Return the registry of ``(module name, descriptors)``; ValueError on a clash or a dangling name."""
        tables: dict[str, dict[str, Any]] = {"engine": {}, "format": {}, "target": {}, "converter": {}}
        origin: dict[tuple[str, str], str] = {}
        kinds = {
            EngineDescriptor: "engine",
            FormatDescriptor: "format",
            TargetDescriptor: "target",
            ConverterDescriptor: "converter",
        }
        for module, descriptors in modules:
            for d in descriptors:
                kind = kinds.get(type(d))
                if kind is None:
                    raise ValueError(f"{module}: {d!r} is not a descriptor")
                if d.name in tables[kind]:
                    raise ValueError(f"{module}: {kind} {d.name!r} is already registered by {origin[(kind, d.name)]}")
                tables[kind][d.name] = d
                origin[(kind, d.name)] = module
        reg = cls(
            engines=_ordered(tables["engine"], _CORE_ENGINES),
            formats=_ordered(tables["format"], _CORE_FORMATS),
            targets=_ordered(tables["target"], _CORE_TARGETS),
            converters=tables["converter"],
            origin=origin,
        )
        reg._check()
        return reg

    def _check(self) -> None:
        def need(kind: str, name: str | None, table: dict[str, Any], where: str) -> None:
            if name is not None and name not in table:
                raise ValueError(f"{where} names unknown {kind} {name!r}; known: {', '.join(sorted(table))}")

        for f in self.formats.values():
            need("engine", f.source_engine, self.engines, f"format {f.name!r}")
            if f.source_engine is None and f.not_a_source is None:
                raise ValueError(f"format {f.name!r} has no source engine: say why in not_a_source")
        for c in self.converters.values():
            for name in (c.source, c.target):
                need("format", name, self.formats, f"converter {c.name!r}")
            need("engine", c.engine, self.engines, f"converter {c.name!r}")
        for t in self.targets.values():
            need("engine", t.engine, self.engines, f"target {t.name!r}")
            for name in (*t.accepts, *t.precisions, t.artifact_format):
                need("format", name, self.formats, f"target {t.name!r}")
        owners: list[EngineDescriptor | FormatDescriptor] = [*self.engines.values(), *self.formats.values()]
        sections = [d.name for d in owners if d.options is not None]
        if len(sections) != len(set(sections)):
            raise ValueError(f"two descriptors contribute spec options under one name: {sorted(sections)}")
        for e in self.engines.values():
            if e.variants and (e.default_variant not in e.variants or e.options is None):
                raise ValueError(f"engine {e.name!r} has variants: give default_variant and an options model")
            if e.options is not None and e.variants and "variant" not in e.options.model_fields:
                raise ValueError(f"engine {e.name!r}: its options model needs a `variant` field")


def _ordered(table: dict[str, Any], core: tuple[str, ...]) -> dict[str, Any]:
    head = {n: table[n] for n in core if n in table}
    return {**head, **{n: d for n, d in table.items() if n not in head}}


def _discover() -> list[tuple[str, Iterable[Descriptor]]]:
    found: list[tuple[str, Iterable[Descriptor]]] = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        name = f"{__name__}.{info.name}"
        found.append((name, importlib.import_module(name).DESCRIPTORS))
    for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        module = ep.load()
        found.append((ep.value, getattr(module, "DESCRIPTORS", module)))
    return found


@cache
def registry() -> Registry:
    """Return the process-wide registry: this package's modules, then the ``kiln.descriptors`` entry points."""
    return Registry.build(_discover())


def engine_family(name: str) -> str:
    """Return the family of a concrete engine name (itself when it has no variants)."""
    for e in registry().engines.values():
        if name == e.name or name in e.concrete():
            return e.name
    return name


def option_sections() -> dict[str, EngineDescriptor | FormatDescriptor]:
    """Return the descriptors that contribute a section of the spec's ``options``, by section name."""
    reg = registry()
    owners: list[EngineDescriptor | FormatDescriptor] = [*reg.engines.values(), *reg.formats.values()]
    return {d.name: d for d in owners if d.options is not None}


def concrete_engines() -> dict[str, EngineDescriptor]:
    """Return every concrete engine (one image and queue each) with its family's descriptor."""
    return {c: e for e in registry().engines.values() for c in e.concrete()}


def readable_formats_hint() -> str:
    """Return the hint naming every source format, for UnsupportedFormat."""
    labels = [f.label for f in registry().formats.values() if f.is_source]
    listed = ", ".join(labels[:-1]) + " and " + labels[-1] if len(labels) > 1 else "".join(labels)
    return f"Kiln reads {listed}; set `source_format` in the spec if detection guessed wrong."


errors.install_formats_hint(readable_formats_hint)
