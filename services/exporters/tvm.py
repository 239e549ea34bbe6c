"""The tvm target: the model compiled by Apache TVM into a native library, weights beside it.

ONNX → Relax (TVM's ONNX frontend) → ``tvm.compile`` for this worker's CPU (LLVM with the
host's ``mcpu``, or the spec's ``options.tvm.mcpu``); optionally MetaSchedule-tuned with the spec's
trial budget, and cross-compiled for a CUDA architecture (``options.tvm.cuda_arch``) without a GPU.
fp32 and fp16 (mixed precision, fp32 I/O). Parity and the benchmark run the CPU library; the
version folder carries a README on loading it (layout in :mod:`services.tvm._compile`).
"""

from __future__ import annotations

from services.artifacts import Artifact
from services.descriptors.tvm import TvmOptions
from services.errors import ConversionFailed
from services.exporters._common import finish_export
from services.formats import Format
from services.passes.pinned_shapes import pin_input_shapes
from services.spec import Precision
from services.steps.context import StepContext
from services.steps.reference import load_reference
from services.tvm import CUDA_LIBRARY, IO_FILE, LIBRARY, PARAMS, README, build_libraries
from services.versions import tool_versions

__all__ = ["SERVING", "export_tvm", "version_readme"]

SERVING = {"tvm": {"library": LIBRARY, "params": PARAMS, "io": IO_FILE}}


def version_readme(name_hint: str, details: dict[str, object], versions: dict[str, str]) -> str:
    """Return the README.md a published version carries: what is there and how to load it."""
    target = details.get("target") or {}
    mcpu = target.get("mcpu") if isinstance(target, dict) else None
    cuda = details.get("cuda")
    lines = [
        f"# {name_hint}: an Apache TVM library",
        "",
        f"Compiled by Kiln with apache-tvm {versions.get('apache-tvm', '?')} "
        f"(apache-tvm-ffi {versions.get('apache-tvm-ffi', '?')}); load it with the same versions.",
        "",
        "| file | what it is |",
        "|---|---|",
        f"| `{LIBRARY}` | Relax VM executable for the CPU (LLVM, `mcpu={mcpu}`): run it on that CPU or a newer one |",
        f"| `{PARAMS}` | the weights (`p0`, `p1`, ... in the order `main` takes them after the inputs) |",
        f"| `{IO_FILE}` | input and output names, dtypes and shapes (`null` for an open axis) |",
    ]
    if cuda:
        lines.append(
            f"| `{CUDA_LIBRARY}` | the same model for CUDA `{cuda['arch'] if isinstance(cuda, dict) else ''}`, "  # type: ignore[index]
            "cross-compiled without a GPU; its kernels are a cubin for that architecture, embedded, so it loads "
            "with the CUDA driver and `libcudart` alone (no NVRTC, no `cuda-bindings`); `device_check` in the "
            "manifest says whether a GPU worker checked it |"
        )
    lines += [
        "| `kiln-manifest.json` | provenance: source, route, tool versions, parity, benchmark |",
        "",
        "Inputs and outputs are float32 at every precision (fp16 computes inside).",
        "",
        "TVM's runtime sizes its CPU thread pool at half the logical CPUs on x86 (it assumes two hyper-threads "
        "per core) unless `TVM_NUM_THREADS` says otherwise, and cannot grow it later: set `TVM_NUM_THREADS` to the "
        f"physical cores the process may use before the first call (Kiln checked and timed this library with "
        f"{details.get('threads', '?')} threads).",
        "",
        "```python",
        "import os",
        'os.environ.setdefault("TVM_NUM_THREADS", str(len(os.sched_getaffinity(0))))  # logical CPUs: halve it where cores have two hyper-threads',
        "import json, numpy as np, tvm",
        "from tvm import relax",
        "",
        "dev = tvm.cpu()  # tvm.cuda() with model_cuda.so",
        f'vm = relax.VirtualMachine(tvm.runtime.load_module("{LIBRARY}"), dev)',
        f'params = tvm.runtime.load_param_dict(open("{PARAMS}", "rb").read())',
        'weights = [tvm.runtime.tensor(params[f"p{i}"].numpy(), dev) for i in range(len(params))]',
        f'io = json.load(open("{IO_FILE}"))',
        'feeds = [tvm.runtime.tensor(np.zeros([d or 1 for d in t["shape"]], t["dtype"]), dev) for t in io["inputs"]]',
        'out = vm["main"](*feeds, *weights)  # one tensor, or a tuple in io["outputs"] order',
        "```",
        "",
    ]
    if cuda:
        lines += [
            f"On a GPU, `{CUDA_LIBRARY}` needs only TVM's runtime (`TVM_USE_RUNTIME_LIB=1`: the compiler library is "
            "not loaded) and its CUDA sidecar:",
            "",
            "```python",
            "import ctypes, os",
            'os.environ["TVM_USE_RUNTIME_LIB"] = "1"',
            "import tvm.runtime",
            "from tvm.runtime.vm import VirtualMachine",
            "",
            "# TVM's CUDA runtime; libcudart.so.13 must be loadable (CUDA 13 wheels: site-packages/nvidia/cu13/lib)",
            'ctypes.CDLL(os.path.join(os.path.dirname(tvm.__file__), "lib", "libtvm_runtime_cuda.so"))',
            "dev = tvm.runtime.cuda(0)",
            f'vm = VirtualMachine(tvm.runtime.load_module("{CUDA_LIBRARY}"), dev)',
            "# then the weights and feeds as above, as tvm.runtime.tensor(..., dev)",
            "```",
            "",
        ]
    return "\n".join(lines)


def export_tvm(ctx: StepContext) -> Artifact:
    """Compile the ONNX model with TVM at the job's precision; validate and benchmark the CPU library."""
    precision = Precision(ctx.step.options.get("precision", ctx.spec.precision.value))
    if precision not in (Precision.FP32, Precision.FP16):
        raise ConversionFailed(  # the planner refuses these first; a direct call gets the same answer
            f"the tvm target builds fp32 and fp16, not {precision.value}",
            hint="Compile for tvm at fp32 or fp16.",
            tool="tvm",
        )
    options = ctx.spec.engine_options(TvmOptions)
    scratch = ctx.scratch / "tvm"
    scratch.mkdir(parents=True, exist_ok=True)
    ref = load_reference(ctx.reference)
    # One parity input per shape: a library that builds at open axes and fails when run on them is
    # rebuilt at fixed shapes like one that does not build (parity would only report the crash).
    first_of_shape = {g: i for i, g in reversed(list(enumerate(ref.shape_of)))}
    probes = [ref.inputs[i] for _, i in sorted(first_of_shape.items())]
    details = build_libraries(
        ctx.model.path,
        ctx.out_dir,
        fp16=precision is Precision.FP16,
        options=options,
        spec_inputs=ctx.spec.inputs,
        scratch=scratch,
        progress=ctx.progress,
        pin_shapes=pin_input_shapes,
        probe_feeds=probes,
        parity_shapes=ref.shapes[0] if ref.shapes else None,
    )
    warnings = []
    if "tuning" not in details:
        # Measured (docs/benchmarks.md): untuned, a 3-conv CNN at 64x64 ran 100x slower than onnxruntime.
        why = "open input axes are not tuned" if options.tuning_trials is None else "options.tvm.tuning_trials is 0"
        warnings.append(
            f"untuned ({why}): TVM's default CPU schedules leave convolutions unvectorised and serial; give "
            "static input shapes (inputs.<name>.shape) and options.tvm.tuning_trials for a library worth deploying"
        )
    built_for = details.get("built_for")
    if built_for:
        shapes = ", ".join(f"{k} {v}" for k, v in built_for["shapes"].items())
        warnings.append(
            f"built for fixed shapes ({shapes}, {built_for['chosen_by']}): {built_for['why']}; the library takes "
            "those shapes only"
            + (
                ""
                if built_for["chosen_by"] == "the spec's inputs"
                else " (give inputs.<name>.shape for the shapes you serve)"
            )
        )
    (ctx.out_dir / README).write_text(version_readme(ctx.spec.name or "model", details, tool_versions("tvm")))
    return finish_export(
        ctx,
        fmt=Format("tvm_library"),
        entry=LIBRARY,
        precision=precision,
        serving=SERVING,
        engine_details=details,
        warnings=warnings,
    )
