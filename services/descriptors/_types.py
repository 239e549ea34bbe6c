"""What an engine, a model format, a target and a converter edge declare about themselves.

Descriptors are plain data (strings, numbers and "module:function" entries), so the API,
the planner and the spec can read every one of them without importing an engine SDK, and
so that ``services.formats`` and ``services.spec`` can build their enums from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel

__all__ = [
    "ConverterDescriptor",
    "EngineDescriptor",
    "FormatDescriptor",
    "TargetDescriptor",
    "WorkerImage",
]


@dataclass(frozen=True)
class WorkerImage:
    """How the engine's worker image is built and run (checked against compose.yaml and the Helm chart).

    ``extras`` are the pyproject extras the image installs (``EXTRAS`` build argument);
    ``dockerfile`` and ``build_target`` name the Dockerfile stage; ``gpus`` is how many GPUs
    one worker reserves (0 for CPU engines), and a GPU worker runs under the ``gpu`` compose
    profiles and is disabled by default in the chart.
    """

    extras: tuple[str, ...]
    dockerfile: str = "docker/Dockerfile"
    build_target: str | None = "worker"
    gpus: int = 0


@dataclass(frozen=True)
class EngineDescriptor:
    """A runtime, the packages and image that carry it, and its queue(s).

    ``variants`` (e.g. TensorRT per CUDA major) give one concrete engine, image and queue
    each: ``<name>-<variant>``; the spec picks one with ``options.<name>.variant``.
    """

    name: str
    description: str
    modules: tuple[str, ...]  # importable modules that prove the engine is installed
    extra: str  # the pyproject extra that installs it
    packages: tuple[str, ...]  # distributions whose versions change what its steps produce
    image: WorkerImage
    #: Modules safe to import in the worker's forkserver (fork-safe, no threads that matter).
    preload: tuple[str, ...] = ()
    variants: dict[str, str] = field(default_factory=dict)  # variant -> description
    default_variant: str | None = None
    #: The engine's spec options (``options.<name>``); a model with a ``variant`` field when it has variants.
    options: type[BaseModel] | None = None
    #: Spec fields from before ``options`` existed: top-level name -> field of ``options``.
    legacy_spec_fields: dict[str, str] = field(default_factory=dict)
    #: "module:function"() -> {name: version} added to the engine's tool versions (cache keys and
    #: manifests): what changes its steps' output besides packages, e.g. the CPU a library is compiled for.
    #: Called on the worker; it must not import the engine SDK.
    extra_versions: str | None = None
    #: "module:function"() -> why the engine cannot run in this process although its modules import (no
    #: GPU, no driver), or None when it can. A worker serves the engine's queue only where it says None.
    #: Like ``extra_versions``, it must not import the engine SDK at module level.
    device: str | None = None

    def concrete(self) -> list[str]:
        """Return the concrete engine names: ``name`` itself, or ``name-<variant>`` for each variant."""
        return [f"{self.name}-{v}" for v in self.variants] if self.variants else [self.name]


@dataclass(frozen=True)
class FormatDescriptor:
    """A model format: a node of the converter graph, how to run it and whether it is a source."""

    name: str
    label: str  # how users know it, for hints: "Keras (.keras/.h5)"
    runner: str | None  # "module:Factory" taking (path, **options) and returning a ModelRunner
    #: The engine family whose worker reads a file of it (reference outputs, `kiln inspect`).
    source_engine: str | None = None
    #: File name endings that suggest it (the dashboard's guess before upload; detection reads content).
    extensions: tuple[str, ...] = ()
    #: Why a file of this format cannot be compiled, and what to submit instead (an engine's binary, say).
    not_a_source: tuple[str, str] | None = None
    #: Content sniffers for formats services/formats/detect.py does not know, tried after its own rules:
    #: ``detect`` "module:function"(path: a file or directory) -> what was seen, or None when not this format;
    #: ``detect_archive`` "module:function"(member names of a zip or tar) -> what was seen, or None.
    detect: str | None = None
    detect_archive: str | None = None
    #: "module:function"(directory) -> the path its loader opens (default: the directory itself).
    loadable: str | None = None
    #: An archive of this format is read whole by its loader (Keras v3, TorchScript) instead of extracted.
    archive_is_the_model: bool = False
    #: "module:function"(the loadable path) run at submission before anything reads the model: raises
    #: UNSAFE_INPUT for what would reach outside the model when loaded (file, network, Python-calling ops).
    vet: str | None = None
    #: The source's spec options (``options.<name>``, e.g. a Hugging Face task); they reach every step's cache key.
    options: type[BaseModel] | None = None

    @property
    def is_source(self) -> bool:
        """Return True when Kiln compiles files of this format (an engine reads it, nothing refuses it)."""
        return self.source_engine is not None and self.not_a_source is None


@dataclass(frozen=True)
class ConverterDescriptor:
    """An edge of the graph: a faithful fp32 conversion between two formats, run on ``engine``'s worker."""

    name: str
    source: str
    target: str
    engine: str  # engine family
    cost: float
    entry: str  # "module:function", called with a StepContext, returns an Artifact
    tool: str  # the library doing the work, for `kiln routes` and the manifest


@dataclass(frozen=True)
class TargetDescriptor:
    """An engine-native artifact a user can ask for, and the exporter that makes it.

    ``accepts`` maps an input format to the cost of exporting from it; ``precisions`` limits
    the precisions per input format (default: all); ``server_root`` is the repository root
    its versions are published under (``triton``, ``tfserving``, ``tflite`` or its own).
    """

    name: str
    engine: str  # engine family
    accepts: dict[str, float]
    entry: str
    artifact_format: str
    server_root: str
    precisions: dict[str, frozenset[str]] = field(default_factory=dict)
    #: Optional check at submission (API and CLI) before anything runs: "module:function"(source, spec).
    preflight: str | None = None
    #: "module:function"(spec) -> what of the artifact runs on a GPU with this spec ("model_cuda.so", "the
    #: CUDA provider"), or None when it all runs on the CPU. A GPU-bound artifact is checked on a GPU
    #: worker when one is live (the plan's ``check:<target>`` step), else published with a warning.
    device_bound: str | None = None
