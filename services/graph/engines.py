"""Engines: the runtimes Kiln drives, each carried by one worker image and one queue.

Derived from the engine descriptors (services/descriptors): an engine with variants gives one
concrete engine per variant (``tensorrt-cu12``, ``tensorrt-cu13``).

Queue names come from here and nowhere else (``kiln.<engine>``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from services.descriptors import registry

__all__ = ["ENGINES", "Engine", "engine", "installed_engines", "queue_name", "tensorrt_engine"]


@dataclass(frozen=True)
class Engine:
    """A runtime and the Python modules its worker image must have."""

    name: str
    modules: tuple[str, ...]  # importable modules that prove the engine is installed
    extra: str  # the pyproject extra that installs it
    description: str
    #: "module:function"() -> why it cannot run here although its modules import (no GPU), or None.
    device: str | None = None

    @property
    def queue(self) -> str:
        return queue_name(self.name)

    def is_installed(self) -> bool:
        """Return True when every module the engine needs can be imported here (and its device is there)."""
        return all(importlib.util.find_spec(m) is not None for m in self.modules) and self.unavailable() is None

    def unavailable(self) -> str | None:
        """Return why the engine's device is missing here (its descriptor's ``device`` check), or None."""
        if self.device is None:
            return None
        module, _, func = self.device.partition(":")
        return getattr(importlib.import_module(module), func)()  # type: ignore[no-any-return]


def queue_name(engine_name: str) -> str:
    """Return the Celery queue that carries ``engine_name``'s steps."""
    return f"kiln.{engine_name}"


def _engines() -> dict[str, Engine]:
    out = {}
    for e in registry().engines.values():
        for name, variant in zip(e.concrete(), e.variants or [None], strict=True):
            described = f"{e.variants[variant]}" if variant else e.description
            out[name] = Engine(name, e.modules, e.extra, described, e.device)
    return out


#: Every concrete engine (one worker image and queue each), derived from services/descriptors.
ENGINES: dict[str, Engine] = _engines()


def engine(name: str) -> Engine:
    """Return the engine called ``name``; NOT_FOUND-style error lists the known ones."""
    try:
        return ENGINES[name]
    except KeyError:
        from services.errors import EngineUnavailable

        raise EngineUnavailable(
            f"unknown engine {name!r}", hint="Known engines: " + ", ".join(sorted(ENGINES))
        ) from None


def tensorrt_engine(variant: str) -> Engine:
    """Return the TensorRT engine for a CUDA variant such as "cu13"."""
    return engine(f"tensorrt-{variant}")


def installed_engines() -> list[Engine]:
    """Return the engines whose SDKs this process can import (what a worker serves)."""
    return [e for e in ENGINES.values() if e.is_installed()]
