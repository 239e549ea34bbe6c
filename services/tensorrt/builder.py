"""Build a serialized TensorRT plan from ONNX with TensorRT's own Python API, per major version.

Two API generations are supported, chosen from ``tensorrt.__version__``:

* **TensorRT 10.x — weakly typed.** The network is created with no flags (explicit batch is
  the only mode since 10.0, so EXPLICIT_BATCH is implied). Precision comes from builder
  flags: ``BuilderFlag.FP16`` lets TensorRT pick fp16 kernels for an fp32 ONNX; int8 is
  explicit quantization — the ONNX already carries Q/DQ nodes (:mod:`services.tensorrt.qdq`)
  and ``BuilderFlag.INT8`` lets TensorRT use them. No calibrator: Q/DQ scales are the
  calibration. Layers without Q/DQ stay fp32.
* **TensorRT 11.x — strongly typed.** 11.0 removed the precision flags and the calibrators;
  every network is strongly typed and its types come from the ONNX. So fp16 means an ONNX
  already converted to fp16 (fp32 I/O kept) and int8 the Q/DQ ONNX; no flag is set. The
  STRONGLY_TYPED creation flag is passed when the enum still has it (11.x accepts and
  ignores it), which also makes the intent explicit in the call.

Both: ``OnnxParser.parse_from_file`` (external weights next to the file are found), the
WORKSPACE memory pool limit, one optimization profile per :class:`ShapeProfile` for the
dynamic inputs, and a timing cache per GPU architecture (:mod:`services.tensorrt.timing_cache`).
``tensorrt`` is imported inside :func:`import_tensorrt`; tests may pass a stand-in module
only to see which calls each version path makes.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from services.errors import ConversionFailed, EngineUnavailable
from services.spec import Precision
from services.tensorrt.device import compute_capability as detect_compute_capability
from services.tensorrt.profiles import ShapeProfile
from services.tensorrt.timing_cache import TimingCacheFile, timing_cache_path

__all__ = [
    "INSTALL_HINT",
    "SUPPORTED_MAJORS",
    "BuildOptions",
    "BuildReport",
    "build_plan",
    "builder_flags",
    "import_tensorrt",
    "network_flags",
    "tensorrt_major",
]

SUPPORTED_MAJORS = (10, 11)

INSTALL_HINT = (
    "TensorRT runs on the kiln.tensorrt-<variant> workers (NVIDIA GPU images). To install it by hand: "
    "pip install --extra-index-url https://pypi.nvidia.com tensorrt-cu12 (CUDA 12) or tensorrt-cu13 "
    "(CUDA 13), plus cuda-python, on a machine with an NVIDIA driver."
)


def import_tensorrt() -> ModuleType:
    """Return the ``tensorrt`` module; ENGINE_UNAVAILABLE with an install hint when it is missing."""
    try:
        import tensorrt
    except (ImportError, OSError) as exc:  # OSError: the wheel is there but libnvinfer is not
        raise EngineUnavailable(f"TensorRT is not available in this worker: {exc}", hint=INSTALL_HINT) from exc
    return tensorrt


def tensorrt_major(trt: Any) -> int:
    """Return the major version of a ``tensorrt`` module; ENGINE_UNAVAILABLE for releases Kiln does not drive."""
    version = str(getattr(trt, "__version__", "0"))
    try:
        major = int(version.split(".")[0])
    except ValueError:
        major = 0
    if major not in SUPPORTED_MAJORS:
        raise EngineUnavailable(
            f"TensorRT {version} is installed; Kiln builds with TensorRT 10.x or 11.x",
            hint=INSTALL_HINT,
            tensorrt_version=version,
        )
    return major


def network_flags(trt: Any, major: int) -> list[str]:
    """Return the NetworkDefinitionCreationFlag names this version path sets."""
    if major >= 11 and hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
        return ["STRONGLY_TYPED"]
    return []


def builder_flags(major: int, precision: Precision) -> list[str]:
    """Return the BuilderFlag names this version path sets for ``precision`` (none on 11.x)."""
    if major >= 11 or precision is Precision.FP32:
        return []
    return ["FP16"] if precision is Precision.FP16 else ["INT8"]


@dataclass(frozen=True)
class BuildOptions:
    """What to build: precision (the ONNX must already be prepared for it on 11.x), ranges, limits."""

    precision: Precision
    profiles: tuple[ShapeProfile, ...]
    workspace_mb: int
    cache_dir: Path | None = None  # root of the timing caches; None builds without one


@dataclass
class BuildReport:
    """How a plan was built: the facts the provenance manifest records."""

    tensorrt_version: str
    compute_capability: str
    api: str
    network_flags: list[str]
    builder_flags: list[str]
    workspace_mb: int
    profiles: list[dict[str, dict[str, list[int]]]]
    timing_cache: dict[str, Any]
    plan_bytes: int
    seconds: float
    parser_warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _logger(trt: Any) -> tuple[Any, deque[str]]:
    """Return a TensorRT logger that also keeps the last messages, for error reports."""
    tail: deque[str] = deque(maxlen=40)

    class _TailLogger(trt.ILogger):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            trt.ILogger.__init__(self)

        def log(self, severity: Any, msg: str) -> None:
            if int(severity) <= int(trt.ILogger.Severity.WARNING):  # errors and warnings only
                tail.append(f"{getattr(severity, 'name', severity)}: {msg}")

    return _TailLogger(), tail


def _parse(parser: Any, onnx_path: Path, tail: deque[str]) -> None:
    if parser.parse_from_file(str(onnx_path)):
        return
    errors = []
    for i in range(parser.num_errors):
        err = parser.get_error(i)
        where = ""
        if hasattr(err, "node_name") and err.node_name():
            where = f" (node {err.node_name()}, op {err.node_operator()})"
        errors.append(f"{err.desc()}{where}")
    raise ConversionFailed(
        f"TensorRT's ONNX parser refused {onnx_path.name}: " + ("; ".join(errors[:5]) or "no error given"),
        hint="The pre-flight did not predict this; the parser's own messages are in the details.",
        tool="tensorrt.OnnxParser",
        errors=errors,
        output_tail=list(tail),
    )


def _add_profiles(builder: Any, config: Any, network: Any, profiles: tuple[ShapeProfile, ...]) -> int:
    dynamic = []
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        shape = tuple(tensor.shape)
        if any(d < 0 for d in shape):
            if getattr(tensor, "is_shape_tensor", False):
                raise ConversionFailed(
                    f"input {tensor.name} is a shape tensor; Kiln does not derive value ranges for those",
                    tool="tensorrt",
                )
            dynamic.append((tensor.name, shape))
    if not dynamic:
        return 0
    for profile in profiles:
        opt_profile = builder.create_optimization_profile()
        for name, shape in dynamic:
            try:
                p = profile[name]
            except KeyError:
                raise ConversionFailed(f"no shape range for TensorRT network input {name}", tool="tensorrt") from None
            if len(p.opt) != len(shape):
                raise ConversionFailed(
                    f"input {name} has rank {len(shape)} in the network, its profile has rank {len(p.opt)}",
                    tool="tensorrt",
                )
            opt_profile.set_shape(name, p.min, p.opt, p.max)
        if config.add_optimization_profile(opt_profile) < 0:
            raise ConversionFailed(f"TensorRT refused the optimization profile {profile.to_dict()}", tool="tensorrt")
    return len(profiles)


def build_plan(
    onnx_path: Path,
    plan_path: Path,
    options: BuildOptions,
    *,
    trt: Any | None = None,
    compute_capability: str | None = None,
) -> BuildReport:
    """Build ``onnx_path`` into a serialized plan at ``plan_path``; return how it was built.

    ENGINE_UNAVAILABLE without TensorRT or a GPU; CONVERSION_FAILED with the parser's or
    builder's messages when TensorRT refuses the model.
    """
    started = time.perf_counter()
    trt = trt if trt is not None else import_tensorrt()
    major = tensorrt_major(trt)
    version = str(trt.__version__)
    cc = compute_capability or detect_compute_capability()
    if not cc:
        raise EngineUnavailable(
            "no CUDA GPU is visible to this worker, and TensorRT builds for the GPU it runs on",
            hint="Run the TensorRT worker with a GPU (docker --gpus all / nvidia.com/gpu resource).",
        )
    logger, tail = _logger(trt)
    builder = trt.Builder(logger)
    net_flags = network_flags(trt, major)
    flag_bits = 0
    for name in net_flags:
        flag_bits |= 1 << int(getattr(trt.NetworkDefinitionCreationFlag, name))
    network = builder.create_network(flag_bits)
    parser = trt.OnnxParser(network, logger)
    _parse(parser, onnx_path, tail)

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, options.workspace_mb * 1024 * 1024)
    b_flags = builder_flags(major, options.precision)
    for name in b_flags:
        config.set_flag(getattr(trt.BuilderFlag, name))
    _add_profiles(builder, config, network, options.profiles)

    cache_file = None
    loaded = b""
    if options.cache_dir is not None:
        cache_file = TimingCacheFile(timing_cache_path(options.cache_dir, cc, version))
        loaded = cache_file.load()
    cache = config.create_timing_cache(loaded)
    config.set_timing_cache(cache, False)  # ignore_mismatch=False: a foreign cache is not trusted

    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise ConversionFailed(
            "TensorRT could not build an engine for this network",
            hint="The builder's messages are in the details; a larger tensorrt_workspace_mb sometimes helps.",
            tool="tensorrt.Builder",
            output_tail=list(tail),
        )
    plan = memoryview(serialized)
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    plan_path.write_bytes(plan)

    cache_info: dict[str, Any] = {"enabled": cache_file is not None}
    if cache_file is not None:
        written = cache_file.store(config, config.get_timing_cache(), loaded=loaded)
        cache_info.update(path=str(cache_file.path), reused_bytes=len(loaded), stored_bytes=written)
    return BuildReport(
        tensorrt_version=version,
        compute_capability=cc,
        api=f"TensorRT {major}.x "
        + ("strongly typed (types from the ONNX)" if major >= 11 else "weakly typed (builder flags)"),
        network_flags=net_flags,
        builder_flags=b_flags,
        workspace_mb=options.workspace_mb,
        profiles=[p.to_dict() for p in options.profiles],
        timing_cache=cache_info,
        plan_bytes=plan.nbytes,
        seconds=round(time.perf_counter() - started, 3),
        parser_warnings=list(tail),
    )
