"""Versions of the tools each engine's steps use: part of cache keys and of every manifest."""

from __future__ import annotations

import importlib
import platform
from functools import cache
from importlib import metadata

import services
from services.descriptors import engine_family, registry

__all__ = ["ENGINE_PACKAGES", "tool_versions"]

#: Distributions whose version changes what an engine's steps produce (from the engine descriptors).
ENGINE_PACKAGES: dict[str, tuple[str, ...]] = {e.name: e.packages for e in registry().engines.values()}


@cache
def tool_versions(engine: str) -> dict[str, str]:
    """Return installed versions of the engine's tools (absent ones omitted), plus Kiln's and Python's."""
    family = engine_family(engine)
    out = {"kiln": services.__version__, "python": platform.python_version()}
    for dist in ENGINE_PACKAGES.get(family, ()):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    engine_desc = registry().engines.get(family)
    if engine_desc is not None and engine_desc.extra_versions:
        module, _, func = engine_desc.extra_versions.partition(":")
        out.update(getattr(importlib.import_module(module), func)())
    return out
