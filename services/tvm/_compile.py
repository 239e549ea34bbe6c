"""ONNX → Relax → ``tvm.compile``: the library, its weights and its I/O description.

The layout a version holds (see :data:`LIBRARY`, :data:`PARAMS`, :data:`IO_FILE`):

- ``model.so``: the Relax VM executable for the CPU (LLVM, the host's ``mcpu`` unless the spec
  names one), its ``main`` taking the model's inputs then the weights;
- ``params.bin``: the weights in TVM's parameter-dict format (``p0``, ``p1``, ... in ``main``'s
  order), already transformed for ``main``: at fp16 they are stored at fp16;
- ``io.json``: input and output names, dtypes and shapes (None for an open axis);
- ``model_cuda.so`` (with ``cuda_arch``): the same graph for a CUDA GPU, cross-compiled here, its
  kernels an embedded cubin for that architecture (services/tvm/cuda.py);
- ``README.md``: how to load it.

Weights leave the graph (``keep_params_in_input``) and ``LiftTransformParams`` moves whatever
depends on weights alone (transposes, fp16 casts) into ``main_transform_params``, run once
here, so ``main`` does no per-call weight work. fp16 is Relax's ``ToMixedPrecision``: conv2d
and matmul compute in fp16 and accumulate in fp32; inputs and outputs stay fp32.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from services.descriptors.tvm import DEFAULT_TUNING_TRIALS, TvmOptions
from services.errors import ConversionFailed, EngineUnavailable, InvalidSpec
from services.tensors import TensorSpec
from services.tvm.host import configure_threads

__all__ = [
    "CUDA_LIBRARY",
    "IO_FILE",
    "LIBRARY",
    "PARAMS",
    "README",
    "build_libraries",
    "cpu_target",
    "import_tvm",
    "onnx_io",
]

LIBRARY = "model.so"
CUDA_LIBRARY = "model_cuda.so"
PARAMS = "params.bin"
IO_FILE = "io.json"
README = "README.md"

_ONNX_DTYPES = {1: "float32", 10: "float16", 11: "float64", 16: "bfloat16", 2: "uint8", 3: "int8", 5: "int16"}
_ONNX_DTYPES |= {6: "int32", 7: "int64", 9: "bool", 4: "uint16", 12: "uint32", 13: "uint64"}


def import_tvm() -> Any:
    """Return the ``tvm`` module, its CPU thread pool sized to this host (services/tvm/host.py);
    ENGINE_UNAVAILABLE with the install hint when it is missing."""
    configure_threads()
    try:
        import tvm
    except ImportError as exc:
        raise EngineUnavailable(
            f"TVM is not installed here: {exc}",
            hint="Install Kiln's `tvm` extra (apache-tvm with apache-tvm-ffi 0.1.14.post1) or run the tvm worker.",
        ) from exc
    return tvm


def onnx_io(model: Any) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Return an ONNX model's graph inputs (initializers excluded) and outputs."""
    inits = {i.name for i in model.graph.initializer}

    def spec(v: Any) -> TensorSpec:
        t = v.type.tensor_type
        dims = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in t.shape.dim)
        return TensorSpec(v.name, _ONNX_DTYPES.get(t.elem_type, str(t.elem_type)), dims)

    return [spec(v) for v in model.graph.input if v.name not in inits], [spec(v) for v in model.graph.output]


def cpu_target(options: TvmOptions, *, for_tuning: bool = False) -> Any:
    """Return the LLVM target: the spec's ``mcpu`` or this host's CPU as LLVM detects it."""
    tvm = import_tvm()
    mcpu = options.mcpu or tvm.target.codegen.llvm_get_system_cpu()
    config: dict[str, Any] = {"kind": "llvm", "mcpu": mcpu}
    if for_tuning:  # MetaSchedule sizes its parallel loops by the core count the target declares: the pool's
        config["num-cores"] = configure_threads()
    try:
        return tvm.target.Target(config)
    except Exception as exc:
        raise InvalidSpec(
            f"LLVM does not know the CPU {mcpu!r}: {exc}", hint="Give options.tvm.mcpu as `llc -mcpu=help` lists it."
        ) from exc


def _static_shapes(inputs: list[TensorSpec], spec_inputs: dict[str, Any]) -> dict[str, list[int]]:
    """Return every input's shape with open axes closed from the spec (``shape``, else ``opt``)."""
    shapes: dict[str, list[int]] = {}
    for t in inputs:
        given = spec_inputs.get(t.name)
        fixed = (given.shape or given.opt) if given is not None else None
        dims = list(t.shape)
        if fixed is not None and len(fixed) == len(dims):
            dims = [d if d is not None else (f if f > 0 else None) for d, f in zip(dims, fixed, strict=True)]
        if any(d is None for d in dims):
            raise InvalidSpec(
                f"MetaSchedule tuning needs static shapes; input {t.name!r} has open axes {list(t.shape)}",
                hint=f'Give inputs.{t.name}.shape (e.g. {{"shape": [1, ...]}}) or set options.tvm.tuning_trials to 0.',
                field=f"inputs.{t.name}",
            )
        shapes[t.name] = [int(d) for d in dims if d is not None]
    return shapes


def _relax_module(
    onnx_model: Any, shape_dict: dict[str, list[int]] | None, fp16: bool, fast_math: bool = True
) -> tuple[Any, list[Any]]:
    """Return the Relax module (``main`` + ``main_transform_params``) and the raw weights."""
    from tvm import relax
    from tvm.relax.frontend.onnx import from_onnx

    from services.tvm._frontend import importer_fixes, prepare_for_import

    with importer_fixes():
        mod = from_onnx(prepare_for_import(onnx_model), shape_dict=shape_dict, keep_params_in_input=True)
    mod, params = relax.frontend.detach_params(mod)
    weights = list(params.get("main", []))
    n_inputs = len(mod["main"].params) - len(weights)
    mod["main"] = mod["main"].with_attr("num_input", n_inputs)
    if fp16:
        mod = relax.transform.ToMixedPrecision(out_dtype="float32")(mod)
    if fast_math:
        # exp, erf and tanh otherwise lower to scalar libm calls, one per element: a transformer
        # block's softmax and GELU took a third of its tuned time. TVM's fast versions are
        # polynomials the loops vectorise (float32; other dtypes keep the exact function).
        mod = relax.transform.FastMathTransform()(mod)
    mod = relax.transform.LiftTransformParams()(mod)
    return mod, weights


def _channels_last(mod: Any, progress: Callable[[str], None]) -> Any:
    """Return ``mod`` with its 2-D convolutions in NHWC/HWIO, the layout MetaSchedule tunes best here.

    In NCHW the innermost loop MetaSchedule vectorises runs along a row of pixels; channels last
    it runs along output channels, which convolutions mostly have in multiples of the vector width.
    Measured on the medium CNN at 300 trials: its convolutions 1.3-2x faster than tuned NCHW
    (docs/benchmarks.md). The input's transpose stays in ``main``; the weights' moves into
    ``main_transform_params``, run once at export. Grouped convolutions keep NCHW (TVM's NHWC
    kernels for them are not the ones measured), and so does a module the pass cannot convert.
    """
    import tvm
    from tvm import relax

    plain: list[Any] = []
    other: list[Any] = []

    def visit(expr: Any) -> None:
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == "relax.nn.conv2d":
            simple = int(expr.attrs.groups) == 1 and str(expr.attrs.data_layout) == "NCHW"
            (plain if simple else other).append(expr)

    relax.analysis.post_order_visit(mod["main"].body, visit)
    if not plain or other:
        return mod
    try:
        with tvm.transform.PassContext(opt_level=3):
            converted = relax.transform.ConvertLayout({"relax.nn.conv2d": ["NHWC", "HWIO"]})(mod)
            return relax.transform.LiftTransformParams()(relax.transform.DeadCodeElimination()(converted))
    except Exception as exc:  # the NCHW module still builds and tunes
        progress(f"keeping NCHW convolutions: TVM's layout conversion failed ({type(exc).__name__}: {exc})")
        return mod


def _fused(mod: Any, target: Any) -> Any:
    import tvm
    from tvm import relax

    passes = [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern()]
    passes += [relax.transform.FoldConstant(), relax.transform.FuseOps(), relax.transform.FuseTIR()]
    with target, tvm.transform.PassContext(opt_level=3):
        return tvm.transform.Sequential(passes)(mod)


def _faster(
    tuned: Any, tuned_weights: list[Any], default: Any, default_weights: list[Any], inputs: list[TensorSpec]
) -> tuple[str, dict[str, Any]]:
    """Return which library runs faster ("tuned" or "default") and the medians, timed call by call."""
    import time

    import numpy as np
    import tvm

    rng = np.random.default_rng(0)
    feeds = [
        tvm.runtime.tensor(rng.standard_normal([d or 1 for d in t.shape]).astype(t.dtype))
        if np.dtype(t.dtype).kind == "f"
        else tvm.runtime.tensor(np.zeros([d or 1 for d in t.shape], dtype=t.dtype))
        for t in inputs
    ]
    runs = {"tuned": (tuned["main"], tuned_weights), "default": (default["main"], default_weights)}
    samples: dict[str, list[float]] = {k: [] for k in runs}
    for round_ in range(25):
        for key, (main, weights) in runs.items():
            started = time.perf_counter()
            main(*feeds, *weights)
            if round_ >= 5:  # the first rounds warm caches and the thread pool
                samples[key].append(time.perf_counter() - started)
    medians = {k: float(np.median(v)) * 1000 for k, v in samples.items()}
    kept = "tuned" if medians["tuned"] <= medians["default"] else "default"
    return kept, {"tuned_ms": round(medians["tuned"], 4), "default_ms": round(medians["default"], 4), "kept": kept}


#: (onnx model, input shapes) -> (the model with them pinned and its shape arithmetic folded, pass records)
PinShapes = Callable[[Any, dict[str, list[int]]], tuple[Any, list[dict[str, Any]]]]


def build_libraries(
    onnx_path: Path,
    out_dir: Path,
    *,
    fp16: bool,
    options: TvmOptions,
    spec_inputs: dict[str, Any],
    scratch: Path,
    progress: Callable[[str], None] = lambda _m: None,
    pin_shapes: PinShapes | None = None,
    probe_feeds: Sequence[dict[str, Any]] = (),
    parity_shapes: dict[str, list[int]] | None = None,
) -> dict[str, Any]:
    """Write model.so, params.bin, io.json (and model_cuda.so) into ``out_dir``; return engine details.

    Open axes stay open where TVM can compile them and the library runs: it is run once on
    each of ``probe_feeds`` (the parity inputs, one per shape) before it is kept. Where TVM
    cannot build it, or the library fails when run (``std::bad_alloc`` from a memory plan over
    open axes), it is built for fixed shapes instead: the spec's concrete shape for every open
    axis, else ``parity_shapes`` (the shape parity checks first); the details say so
    (``built_for``) and the io.json declares them, so parity and the runner feed only those.
    ``pin_shapes`` puts them in the graph and folds its shape arithmetic first (the exporter
    passes services/passes/pinned_shapes.py's: the passes sit beside this package, not below it).
    """
    import onnx

    model = onnx.load(str(onnx_path))
    inputs, outputs = onnx_io(model)
    details: dict[str, Any] = {}
    trials, shape_dict = _tuning_plan(inputs, spec_inputs, options)
    try:
        inputs = _build(
            model, inputs, shape_dict, out_dir, fp16, options, scratch, progress, details, probe_feeds, trials
        )
    except (ConversionFailed, InvalidSpec, EngineUnavailable):
        raise
    except Exception as exc:
        pinned, chosen_by = _given_shapes(inputs, spec_inputs), "the spec's inputs"
        if pinned is None and parity_shapes is not None and any(None in t.shape for t in inputs):
            pinned = {t.name: list(parity_shapes[t.name]) for t in inputs if t.name in parity_shapes}
            pinned, chosen_by = (pinned, "the parity inputs' shape") if len(pinned) == len(inputs) else (None, "")
        if shape_dict is not None or pinned is None:
            raise _tvm_failed(exc, fixed_shapes=shape_dict is not None) from exc
        why = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        progress(f"TVM cannot compile or run the open axes ({why}); building for {chosen_by}, {pinned}")
        details.clear()
        try:
            # The shapes go into the graph and its shape arithmetic is folded first: given to
            # the importer alone they leave Reshape targets it cannot infer on real models.
            fixed, passes = pin_shapes(model, pinned) if pin_shapes is not None else (model, [])
            probes = [f for f in probe_feeds if all(list(np.shape(f[k])) == v for k, v in pinned.items() if k in f)]
            # A library fixed at these shapes is tuned like any static one (the default budget unless the spec names one).
            trials = default_tuning_trials() if options.tuning_trials is None else options.tuning_trials
            inputs = _build(fixed, inputs, pinned, out_dir, fp16, options, scratch, progress, details, probes, trials)
        except (ConversionFailed, InvalidSpec, EngineUnavailable):
            raise
        except Exception as again:
            raise _tvm_failed(again, fixed_shapes=True) from again
        details["built_for"] = {
            "shapes": pinned,
            "chosen_by": chosen_by,
            "why": f"TVM could not compile or run the open axes: {why}",
            "passes": [r["name"] for r in passes if r["modified"]],
        }
    io = {"inputs": [t.to_dict() for t in inputs], "outputs": [t.to_dict() for t in outputs]}
    (out_dir / IO_FILE).write_text(json.dumps(io, indent=2) + "\n")
    return details


def default_tuning_trials() -> int:
    """Return the budget a static library gets when the spec names none: ``KILN_TVM_DEFAULT_TRIALS``, else Kiln's."""
    try:
        return max(0, int(os.environ.get("KILN_TVM_DEFAULT_TRIALS", DEFAULT_TUNING_TRIALS)))
    except ValueError:
        return DEFAULT_TUNING_TRIALS


def _tuning_plan(
    inputs: list[TensorSpec], spec_inputs: dict[str, Any], options: TvmOptions
) -> tuple[int, dict[str, list[int]] | None]:
    """Return the trial budget of the first build and the static shapes it is built at (None: open axes).

    A budget the spec names tunes at static shapes (open axes closed from the spec, else
    INVALID_SPEC); the default budget tunes a model whose shapes are all static and leaves open
    axes open and untuned (tuning would fix them).
    """
    if options.tuning_trials:
        return options.tuning_trials, _static_shapes(inputs, spec_inputs)
    if options.tuning_trials is None and all(None not in t.shape for t in inputs):
        trials = default_tuning_trials()
        return trials, ({t.name: [int(d) for d in t.shape if d is not None] for t in inputs} if trials else None)
    return 0, None


class LibraryRunFailed(RuntimeError):
    """The library TVM built failed when run on a parity input (it builds, it does not run)."""


def _probe(vm: Any, weights: list[Any], inputs: list[TensorSpec], feeds: Sequence[dict[str, Any]]) -> None:
    """Run the library once on each feed; LibraryRunFailed names the shapes it failed at."""
    import tvm

    for feed in feeds:
        if any(t.name not in feed for t in inputs):
            continue
        args = [tvm.runtime.tensor(np.ascontiguousarray(feed[t.name], dtype=t.dtype)) for t in inputs]
        try:
            vm["main"](*args, *weights)
        except Exception as exc:
            shapes = {t.name: list(np.shape(feed[t.name])) for t in inputs}
            first = str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else type(exc).__name__
            raise LibraryRunFailed(f"the library failed when run at {shapes}: {first}") from exc


def _build(
    model: Any,
    inputs: list[TensorSpec],
    shape_dict: dict[str, list[int]] | None,
    out_dir: Path,
    fp16: bool,
    options: TvmOptions,
    scratch: Path,
    progress: Callable[[str], None],
    details: dict[str, Any],
    probe_feeds: Sequence[dict[str, Any]] = (),
    trials: int = 0,
) -> list[TensorSpec]:
    """Import, (tune,) compile, run once on ``probe_feeds`` and write the libraries at ``shape_dict`` (None: open axes); return the io inputs."""
    tvm = import_tvm()
    from tvm import relax

    target = cpu_target(options, for_tuning=bool(trials))
    details.update(
        {
            "target": {"kind": "llvm", "mcpu": str(target.attrs["mcpu"])},
            "precision": {"mixed_precision": "fp16 compute, fp32 accumulate", "io": "float32"} if fp16 else "fp32",
            "weights": PARAMS,
            "fast_math": options.fast_math,
            "threads": configure_threads(),
        }
    )
    progress("importing ONNX into Relax")
    base, weights = _relax_module(model, shape_dict, fp16, options.fast_math)
    mod = base
    if shape_dict is not None:
        inputs = [TensorSpec(t.name, t.dtype, tuple(shape_dict[t.name])) for t in inputs]
    if shape_dict is not None and trials:
        from services.tvm._tuning import tune_module, tuning_store

        progress(
            f"tuning with MetaSchedule ({trials} trials, at most {options.tuning_seconds} s; kernels tuned before are reused)"
        )
        fused = _fused(_channels_last(base, progress), target)
        mod, summary = tune_module(
            fused, target, trials, scratch / "tuning", store=tuning_store(), seconds=options.tuning_seconds
        )
        details["tuning"] = {**summary, "static_shapes": shape_dict}
    progress(f"compiling for {details['target']['mcpu']}")
    executable = tvm.compile(mod, target=target)
    vm = relax.VirtualMachine(executable, tvm.cpu())
    transformed = list(vm["main_transform_params"](weights))
    if "tuning" in details:
        # A small budget can pick schedules slower than TVM's defaults (measured: 64 trials made a
        # transformer block 1.4x slower); keep whichever library is faster on these shapes.
        default_exec = tvm.compile(base, target=target)
        default_vm = relax.VirtualMachine(default_exec, tvm.cpu())
        default_weights = list(default_vm["main_transform_params"](weights))
        kept, timing = _faster(vm, transformed, default_vm, default_weights, inputs)
        details["tuning"]["speed_check"] = timing
        if kept == "default":
            progress("TVM's default schedules are faster than the tuned ones: keeping them")
            executable, transformed = default_exec, default_weights
            vm = default_vm
    if probe_feeds:
        progress(f"running the library on {len(probe_feeds)} parity input(s)")
        _probe(vm, transformed, inputs, probe_feeds)
    executable.export_library(str(out_dir / LIBRARY))
    blob = tvm.runtime.save_param_dict({f"p{i}": w for i, w in enumerate(transformed)})
    (out_dir / PARAMS).write_bytes(bytes(blob))
    details["params"] = {"count": len(transformed), "dtypes": sorted({str(w.dtype) for w in transformed})}
    if options.cuda_arch:
        from services.tvm.cuda import build_cuda_library

        progress(f"cross-compiling for CUDA {options.cuda_arch}")
        built = build_cuda_library(base, options.cuda_arch, out_dir / CUDA_LIBRARY, scratch / "cuda", progress)
        details["cuda"] = {"library": CUDA_LIBRARY, **built}
    return inputs


def _tvm_failed(exc: BaseException, *, fixed_shapes: bool) -> ConversionFailed:
    """CONVERSION_FAILED for TVM's error; the hint names only what would change the outcome."""
    hint = None
    if "must have the same datatype" in str(exc):
        # TVM 0.27's ONNX frontend folds a Shape -> Cast -> Sqrt chain (an attention scale) into a
        # float64 scalar and then refuses float32 / float64; Kiln's constant folding removes the chain.
        hint = "Compile with optimize: true (the default) so Kiln folds shape arithmetic before TVM imports it."
    elif not fixed_shapes and ("shape" in str(exc).lower() or isinstance(exc, LibraryRunFailed)):
        # Only at open axes: the same failure at fixed shapes is not one that shapes would change.
        hint = "Give every open input axis a concrete size (inputs.<name>.shape, or kiln compile --input NAME:1x3x480x640) and Kiln builds the library for it."
    return ConversionFailed(
        f"TVM cannot compile the model: {exc}", hint=hint, tool="tvm.relax", output=str(exc)[-4000:]
    )


def _given_shapes(inputs: list[TensorSpec], spec_inputs: dict[str, Any]) -> dict[str, list[int]] | None:
    """Every input's shape with its open axes closed by the spec's concrete ``shape`` (or ``opt``); None when any stays open or none is open."""
    if all(None not in t.shape for t in inputs):
        return None
    try:
        return _static_shapes(inputs, spec_inputs)
    except InvalidSpec:
        return None
