"""Which engines this worker's image can run, and refusing to serve the ones it cannot."""

from __future__ import annotations

from services.errors import EngineUnavailable
from services.graph.engines import ENGINES, installed_engines
from services.tune.plan import TUNE_ENGINE
from services.versions import tool_versions
from workers.queues import serves_tune, tunable_engines

__all__ = ["engine_versions", "resolve_engines", "resolve_served"]


def resolve_engines(requested: list[str] | tuple[str, ...]) -> list[str]:
    """Return the engines to serve: ``requested`` (each must be installed here) or every installed one.

    Raises ENGINE_UNAVAILABLE naming the missing SDK and the engines this image does have.
    """
    installed = [e.name for e in installed_engines()]
    if not requested:
        if not installed:
            raise EngineUnavailable("no engine SDK is installed in this environment")
        return installed
    out = []
    for name in requested:
        if name not in ENGINES:
            raise EngineUnavailable(f"unknown engine {name!r}", hint="Known engines: " + ", ".join(ENGINES) + ".")
        eng = ENGINES[name]
        if not eng.is_installed():
            missing = [m for m in eng.modules if not _importable(m)]
            if not missing:  # the modules are there, the device is not (the GPU engine on a CPU box)
                raise EngineUnavailable(
                    f"engine {name} cannot run here: {eng.unavailable()}",
                    hint=f"Run its worker where the device is (the worker-{name} image on a GPU node); "
                    f"engines installed here: {', '.join(installed) or 'none'}.",
                    engine=name,
                )
            raise EngineUnavailable(
                f"engine {name} cannot run here: module(s) {', '.join(missing)} not installed",
                hint=f"Install it with pip install 'kiln[{eng.extra}]' or use an image built for it; "
                f"engines installed here: {', '.join(installed) or 'none'}.",
                engine=name,
            )
        if name not in out:
            out.append(name)
    return out


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def engine_versions(engines: list[str]) -> dict[str, dict[str, str]]:
    """Return the tool versions each served engine runs with (shown by GET /engines)."""
    return {e: tool_versions(e) for e in engines}


def resolve_served(requested: list[str] | tuple[str, ...]) -> tuple[list[str], list[str]]:
    """Return (the engines this worker loads, the names whose queues it serves) for ``requested``.

    ``tune`` asks for the tune queue (kiln.tune) alone: the worker then loads every tunable engine
    installed here (ENGINE_UNAVAILABLE when fewer than two are) and takes no compile step. A
    worker serving two or more tunable engines takes tune jobs as well (workers/queues.py).
    """
    rest = [e for e in requested if e != TUNE_ENGINE]
    if TUNE_ENGINE in requested:
        tunable = [e for e in tunable_engines() if e in ENGINES and ENGINES[e].is_installed()]
        if len(tunable) < 2:
            raise EngineUnavailable(
                "a tune worker needs two or more of "
                + ", ".join(tunable_engines())
                + f" installed; found {tunable or 'none'}",
                hint="Build its image with those extras (EXTRAS=onnxruntime,openvino,tensorflow,torch,service).",
                engine=TUNE_ENGINE,
            )
        engines = resolve_engines(rest) if rest else tunable
        return engines, [*rest, TUNE_ENGINE]
    engines = resolve_engines(rest)
    return engines, [*engines, TUNE_ENGINE] if serves_tune(engines) else list(engines)
