"""The mnn target: model.mnn at fp32, fp16 or int8, converted from ONNX by MNN's own converter.

- fp32: MNNConvert from the optimised ONNX model. GELU keeps its exact erf form
  (``--useGeluApproximation 0``): MNN's default tanh approximation is off by up to 1.4e-4 on
  the tests' transformer block, beyond fp32 tolerance.
- fp16: ``--fp16``: convolution and matmul weights stored as half floats; MNN widens them on
  load. Compute is fp32 on a CPU without fp16 arithmetic (every x86 without AVX512-FP16); on
  ARMv8.2 and later, MNN's ``precision: low`` computes in fp16. Parity runs at ``low``.
- int8: full integer quantisation by MNN's offline quantiser (``mnnquant``), weights and
  activations int8, calibrated with MNN's KL method on the job's calibration samples (or
  generated ones, labelled so). The quantiser cannot quantise an exact-erf GELU and aborts,
  so this conversion lets MNN fuse GELU in its tanh form, which int8 tolerances absorb. When
  the quantiser cannot take a model (it aborts, or quantises no convolution) or its artifact
  fails parity, the target falls back to weight-only int8 (``--weightQuantBits 8``, float
  activations) and says so in a warning.

Caffe models convert natively too (``MnnSource``: MNNConvert's ``-f CAFFE`` reads the
``.prototxt`` and ``.caffemodel``; 58 Caffe layer types, ``--OP`` lists them), through the same
precisions, for an input artifact of kind ``caffe`` (a folder with one of each); the converter
graph has no Caffe format yet, so no route leads there today.

The converter and quantiser run in a child Python process that refuses network access and
process starts (services/exporters/mnn_tool.py says why: the wheel's Python wrappers phone
home and pip-install on import; Kiln never imports them).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from services.artifacts import Artifact
from services.errors import ConversionFailed, ParityFailed
from services.exporters import mnn_tool
from services.exporters._common import calibration_feeds, calibration_warnings, finish_export
from services.formats import Format
from services.spec import Precision
from services.steps.context import StepContext
from services.steps.reference import load_reference
from services.tensors import TensorSpec

__all__ = [
    "CAFFE_KIND",
    "MODEL_FILE",
    "README",
    "SERVING",
    "MnnSource",
    "MnnToolError",
    "convert",
    "convert_onnx",
    "export_mnn",
    "model_summary",
    "onnx_tensor_specs",
    "quantize_full_int8",
    "run_tool",
    "version_readme",
    "write_calibration",
]

MODEL_FILE = "model.mnn"
#: Beside model.mnn: the session settings parity ran with, and how to load it so.
README = "README.md"
#: No model server loads .mnn files; the version directory is what an app (or an MNN-based
#: service) downloads. Published under the repository's ``mnn/`` root.
SERVING: dict[str, Any] = {"mnn": {"runtime": "MNN (C++, Python, Java/Android, iOS)"}}
TOOL = "MNNConvert"
#: The quantiser's statistics settle well before this many samples; each one is a forward pass.
MAX_CALIBRATION_SAMPLES = 300
#: A .mnn whose JSON dump would be larger than this is not summarised (the dump writes every weight).
SUMMARY_MAX_BYTES = 64 << 20
#: One converter or quantiser run; the step's own time limit bounds the job as a whole.
TOOL_TIMEOUT_S = 3600
_BIZ_CODE = "kiln"
#: The artifact kind (Format value) of a Caffe model, for when the converter graph has that format.
CAFFE_KIND = "caffe"


class MnnToolError(Exception):
    """The MNN tool process failed: its exit code and the tail of what it printed."""

    def __init__(self, message: str, *, output: str = "", result: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.output = output
        self.result = result or {}

    @property
    def forbidden(self) -> bool:
        """Return True when the tool tried to reach the network, start a program or import a refused module."""
        return bool(self.result.get("denied") or self.result.get("denied_modules_loaded"))


def run_tool(request: dict[str, Any], scratch: Path, *, python: str | None = None) -> tuple[dict[str, Any], str]:
    """Run one mnn_tool request in a fresh ``python -I`` process; return its result and its output."""
    scratch.mkdir(parents=True, exist_ok=True)
    n = len(list(scratch.glob("request-*.json")))
    req_path, res_path = scratch / f"request-{n}.json", scratch / f"result-{n}.json"
    req_path.write_text(json.dumps({**request, "result": str(res_path)}))
    try:
        proc = subprocess.run(
            [python or sys.executable, "-I", mnn_tool.__file__, str(req_path)],
            capture_output=True,
            text=True,
            timeout=TOOL_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise MnnToolError(f"{request['op']} ran past {TOOL_TIMEOUT_S} s", output=str(exc.stdout or "")) from exc
    output = (proc.stdout + proc.stderr).strip()
    print(output, file=sys.stderr)  # the tool's own log belongs in the job's log
    result = json.loads(res_path.read_text()) if res_path.is_file() else {}
    if result.get("denied") or result.get("denied_modules_loaded"):
        raise MnnToolError(
            f"the MNN tool tried what Kiln forbids it: {result.get('denied') or result.get('denied_modules_loaded')}",
            output=output,
            result=result,
        )
    if proc.returncode != 0 or not result.get("ok"):
        why = f"exit code {proc.returncode}" if proc.returncode >= 0 else f"killed by signal {-proc.returncode}"
        raise MnnToolError(f"{request['op']} failed ({why})", output=output, result=result)
    return result, output


def _cause(output: str) -> str:
    """Return the converter's most telling line: its last error, else its last line."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    telling = ("error", "not support", "terminate", "failed")
    errors = [ln for ln in lines if any(t in ln.lower() for t in telling) and "converted failed" not in ln.lower()]
    return (errors or lines or ["no output"])[-1][:300]


@dataclass(frozen=True)
class MnnSource:
    """What MNNConvert reads: an ONNX file, or a Caffe model (``.prototxt`` structure + ``.caffemodel`` weights)."""

    framework: str  # MNNConvert's -f: "ONNX" or "CAFFE"
    model_file: Path
    prototxt: Path | None = None

    @classmethod
    def from_artifact(cls, model: Artifact) -> MnnSource:
        """Return the converter's input for a step's model artifact (ONNX, or a Caffe model's folder)."""
        if model.kind != CAFFE_KIND:
            return cls("ONNX", model.path)
        from services.formats.caffe import find_caffe_files

        root = model.root if model.root.is_dir() else model.path.parent
        # The same deploy prototxt the Caffe source's vetting and reference read (beside a
        # train_val or solver file, the *deploy* one), never a second guess here.
        found = find_caffe_files(root)
        if found is None:
            raise ConversionFailed(f"{root.name} does not hold one deploy .prototxt and one .caffemodel", tool=TOOL)
        proto, weights = found
        return cls("CAFFE", weights, proto)

    def argv(self) -> list[str]:
        files = ["--modelFile", str(self.model_file)]
        return ["-f", self.framework, *files, *(["--prototxt", str(self.prototxt)] if self.prototxt else [])]


def convert(source: MnnSource, dst: Path, scratch: Path, *, flags: list[str], exact_gelu: bool = True) -> list[str]:
    """Convert ``source`` to ``dst`` with MNNConvert; return the converter flags used (beyond the files)."""
    chosen = ["--bizCode", _BIZ_CODE, "--useGeluApproximation", "0" if exact_gelu else "1", *flags]
    dst.unlink(missing_ok=True)
    try:
        _, output = run_tool({"op": "convert", "argv": [*source.argv(), "--MNNModel", str(dst), *chosen]}, scratch)
    except MnnToolError as exc:
        if exc.forbidden:
            raise ConversionFailed(str(exc), tool=TOOL, output_tail=exc.output[-2000:]) from exc
        output, failure = exc.output, f" ({exc})"  # e.g. "convert failed (killed by signal 11)"
    else:
        failure = ""
    # MNNConvert returns true even when it prints "Converted Failed!" (an op it lacks): the file decides.
    if not dst.is_file() or dst.stat().st_size == 0:
        raise ConversionFailed(
            f"{TOOL} could not convert the {source.framework} model{failure}: {_cause(output)}",
            hint="MNN's converter lacks an op or an attribute this graph uses; the onnxruntime or openvino "
            "targets read the ONNX model directly.",
            tool=TOOL,
            output_tail=output[-2000:],
        )
    return chosen[2:]


def convert_onnx(src: Path, dst: Path, scratch: Path, *, flags: list[str], exact_gelu: bool = True) -> list[str]:
    """Convert ONNX ``src`` to ``dst`` with MNNConvert; return the converter flags used."""
    return convert(MnnSource("ONNX", src), dst, scratch, flags=flags, exact_gelu=exact_gelu)


def model_summary(model: Path, scratch: Path) -> dict[str, Any]:
    """Return the ops of a .mnn and how its convolution/matmul weights are stored (empty when too large)."""
    if model.stat().st_size > SUMMARY_MAX_BYTES:
        return {}
    try:
        result, _ = run_tool({"op": "summary", "model": str(model), "scratch": str(scratch)}, scratch)
    except MnnToolError as exc:
        if exc.forbidden:
            raise ConversionFailed(str(exc), tool=TOOL, output_tail=exc.output[-2000:]) from exc
        return {}
    return {k: result[k] for k in ("ops", "conv_weights", "int8_activation_convs") if k in result}


def onnx_tensor_specs(path: Path) -> dict[str, list[dict[str, Any]]]:
    """Return the ONNX model's inputs and outputs (None for open axes), as the runner's ``tensor_specs``."""
    import onnx

    from services.onnx_io import load_onnx

    model = load_onnx(path, load_external_data=False)

    def spec(vi: onnx.ValueInfoProto) -> dict[str, Any]:
        tt = vi.type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).name if tt.elem_type else "float32"
        shape = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in tt.shape.dim)
        return TensorSpec(vi.name, dtype, shape).to_dict()

    inits = {i.name for i in model.graph.initializer}
    return {
        "inputs": [spec(v) for v in model.graph.input if v.name not in inits],
        "outputs": [spec(v) for v in model.graph.output],
    }


def _safe_name(name: str) -> bool:
    return bool(name) and not name.startswith("/") and ".." not in Path(name).parts


def write_calibration(feeds: list[dict[str, np.ndarray]], root: Path) -> dict[str, Any]:
    """Write ``feeds`` in the quantiser's "sequence" layout; return the quantiser's config (without ``path``).

    One folder per sample; in it ``<input>.txt`` (the values as rows of the last axis, which
    is how the quantiser reads them back) and ``input.json`` (each input's shape).
    """
    feeds = feeds[:MAX_CALIBRATION_SAMPLES]
    if not feeds:
        raise ValueError("no calibration samples")
    for i, feed in enumerate(feeds):
        sample = root / f"{i:05d}"
        sample.mkdir(parents=True)
        for name, arr in feed.items():
            if not _safe_name(name):
                raise ValueError(f"input name {name!r} cannot name a calibration file")
            values = np.asarray(arr, dtype=np.float32)
            rows = values.reshape(-1, values.shape[-1]) if values.ndim else values.reshape(1, 1)
            target = sample / f"{name}.txt"
            target.parent.mkdir(parents=True, exist_ok=True)
            np.savetxt(target, rows, fmt="%.9g")
        shapes = [{"name": n, "shape": list(np.shape(a))} for n, a in feed.items()]
        (sample / "input.json").write_text(json.dumps({"inputs": shapes}))
    first = feeds[0]
    return {
        "used_sample_num": len(feeds),
        # KL on the tests' CNN: cosine 0.99987 on held-out rows; EMA, the quantiser's other
        # one-pass method, gave 0.928 there (ADMM needs every sample in one batch).
        "feature_quantize_method": "KL",
        "weight_quantize_method": "MAX_ABS",
        "feature_clamp_value": 127,
        "weight_clamp_value": 127,
        "batch_size": 1,
        "quant_bits": 8,
        "input_type": "sequence",
        "inputs": [{"name": n, "shape": list(np.shape(a))} for n, a in first.items()],
    }


def quantize_full_int8(
    source: MnnSource, dst: Path, feeds: list[dict[str, np.ndarray]], scratch: Path
) -> tuple[list[str], dict[str, Any]]:
    """Write a full-int8 ``dst`` (weights and activations) by MNN's offline quantiser; return flags and settings.

    Raises MnnToolError when the quantiser cannot take the model.
    """
    float_model = scratch / "float-for-int8.mnn"
    flags = convert(source, float_model, scratch, flags=[], exact_gelu=False)
    calib_dir = scratch / "calibration"
    try:
        config = write_calibration(feeds, calib_dir)
    except ValueError as exc:
        raise MnnToolError(str(exc)) from exc
    config_path = scratch / "quant-config.json"
    config_path.write_text(json.dumps({**config, "path": str(calib_dir)}))
    # The quantiser writes a JSON of its scales beside its output: quantise in scratch, publish the model alone.
    quantized = scratch / "int8.mnn"
    run_tool({"op": "quantize", "src": str(float_model), "dst": str(quantized), "config": str(config_path)}, scratch)
    shutil.copyfile(quantized, dst)
    settings = {
        "mode": "full int8 (weights and activations)",
        "tool": "mnnquant (MNN offline quantiser)",
        "feature_quantize_method": config["feature_quantize_method"],
        "weight_quantize_method": config["weight_quantize_method"],
        "samples": config["used_sample_num"],
        "gelu": "tanh approximation (the quantiser cannot quantise exact-erf GELU)",
    }
    return flags, settings


def _weight_only_int8(source: MnnSource, dst: Path, scratch: Path) -> tuple[list[str], dict[str, Any]]:
    flags = convert(source, dst, scratch, flags=["--weightQuantBits", "8"])
    return flags, {"mode": "weight-only int8 (float activations)", "tool": TOOL, "weight_quant_bits": 8}


def version_readme(name: str, runtime: dict[str, Any], specs: dict[str, list[dict[str, Any]]]) -> str:
    """Return the README.md a published version carries: the session settings parity used, and how to load so.

    MNN's defaults are not those settings: loaded without ``rearrange`` (and at precision
    ``normal``), MNN 3.6 runs other convolution kernels, and PP-OCRv4 det's fp32 map came out
    1.75e-3 of its maximum from the source instead of 1.6e-5 (docs/benchmarks.md).
    """
    rows = [
        f"| `{t['name']}` | {'int32 (the ids, as MNN computes integers)' if t['dtype'].startswith(('int', 'uint')) else 'float32'} | "
        f"{['?' if d is None else d for d in t['shape']]} |"
        for t in specs["inputs"]
    ]
    return "\n".join(
        [
            f"# {name}: an MNN model",
            "",
            "Kiln compared this file with the source model on MNN's CPU backend with the session settings below;",
            "load it with the same ones to get the outputs Kiln measured (the manifest's `engine_details.runtime`).",
            "MNN's defaults differ: without `rearrange=True` MNN runs other convolution kernels, which on a real",
            "fp32 detector moved the output by 1.75e-3 of its largest value instead of 1.6e-5.",
            "",
            "| setting | value |",
            "|---|---|",
            f"| backend | {runtime['backend']} |",
            f"| precision | {runtime['precision']} |",
            f"| rearrange | {runtime['rearrange']} (weights packed for the CPU kernels when the file loads) |",
            "",
            "| input | dtype | shape (`?`: any size) |",
            "|---|---|---|",
            *rows,
            "",
            "```python",
            "import MNN, numpy as np",
            "",
            'info = MNN.nn.load_module_from_file("model.mnn", [], []).get_info()',
            f'runtime = MNN.nn.create_runtime_manager(({{"backend": "{runtime["backend"]}", "precision": "{runtime["precision"]}"}},))',
            "net = MNN.nn.load_module_from_file(",
            '    "model.mnn", info["inputNames"], info["outputNames"], runtime_manager=runtime, rearrange=True',
            ")",
            "x = np.zeros([1, 3, 224, 224], np.float32)  # each input at its shape",
            "out = net.forward([MNN.expr.const(x, list(x.shape), MNN.expr.NCHW, MNN.expr.float)])",
            "values = [np.array(MNN.expr.convert(o, MNN.expr.NCHW).read()) for o in out]",
            "```",
            "",
        ]
    )


def _stored_specs(path: Path) -> dict[str, list[dict[str, Any]]]:
    """Return the signature a .mnn file stores (a Caffe source has no ONNX signature to give)."""
    from services.runners.mnn import MnnRunner

    runner = MnnRunner(path)
    return {"inputs": [t.to_dict() for t in runner.inputs], "outputs": [t.to_dict() for t in runner.outputs]}


def _finish(
    ctx: StepContext, precision: Precision, details: dict[str, Any], warnings: list[str], **kw: Any
) -> Artifact:
    runtime_precision = "low" if precision is Precision.FP16 else "high"
    details["runtime"] = {"backend": "CPU", "precision": runtime_precision, "rearrange": True}
    readme_specs = kw["specs"] or _stored_specs(ctx.out_dir / MODEL_FILE)
    (ctx.out_dir / README).write_text(version_readme(ctx.spec.name or "model", details["runtime"], readme_specs))
    return finish_export(
        ctx,
        fmt=Format("mnn"),
        entry=MODEL_FILE,
        precision=precision,
        serving=SERVING,
        runner_options={"precision": runtime_precision, "tensor_specs": kw["specs"]},
        engine_details=details,
        warnings=warnings,
        fp32_baseline=kw.get("baseline"),
    )


def export_mnn(ctx: StepContext) -> Artifact:
    """Write model.mnn at the job's precision, validated and benchmarked on MNN's CPU backend."""
    from importlib import metadata

    precision = Precision(ctx.step.options.get("precision", ctx.spec.precision.value))
    source = MnnSource.from_artifact(ctx.model)
    dst = ctx.out_dir / MODEL_FILE
    scratch = ctx.scratch / "mnn"
    scratch.mkdir(parents=True, exist_ok=True)
    # A Caffe prototxt fixes every dim, and the .mnn keeps them: its own signature is the right one.
    specs = onnx_tensor_specs(source.model_file) if source.framework == "ONNX" else None
    details: dict[str, Any] = {"mnn": metadata.version("mnn"), "converter": f"{TOOL} (the mnn wheel's _tools module)"}
    baseline = None
    if precision is not Precision.FP32 and ctx.spec.bench.enabled:
        # The same model at fp32, to time the artifact against (kept out of the artifact).
        baseline = scratch / "fp32-baseline.mnn"
        convert(source, baseline, scratch, flags=[])
    if precision is Precision.FP32:
        ctx.progress(f"converting {source.framework} to MNN")
        details["convert_flags"] = convert(source, dst, scratch, flags=[])
    elif precision is Precision.FP16:
        ctx.progress(f"converting {source.framework} to MNN with fp16 weights")
        details["convert_flags"] = convert(source, dst, scratch, flags=["--fp16"])
        details["fp16"] = {"weights": "float16", "compute": "fp16 where the CPU has fp16 arithmetic, else fp32"}
    elif precision is Precision.INT8:
        return _export_int8(ctx, source, dst, scratch, specs, details, baseline)
    else:
        raise ConversionFailed(
            f"the mnn target has no {precision.value} route", hint="Compile mnn at fp32, fp16 or int8.", tool=TOOL
        )
    details["weights"] = model_summary(dst, scratch)
    return _finish(ctx, precision, details, [], specs=specs, baseline=baseline)


def _export_int8(
    ctx: StepContext,
    source: MnnSource,
    dst: Path,
    scratch: Path,
    specs: dict[str, list[dict[str, Any]]] | None,
    details: dict[str, Any],
    baseline: Path | None,
) -> Artifact:
    feeds, label = calibration_feeds(load_reference(ctx.reference))
    warnings = calibration_warnings(label)
    full_failed: str | None = None
    ctx.progress(f"quantising to full int8 with MNN's quantiser on {min(len(feeds), MAX_CALIBRATION_SAMPLES)} samples")
    try:
        flags, settings = quantize_full_int8(source, dst, feeds, scratch / "full-int8")
        summary = model_summary(dst, scratch)
        if summary and not summary.get("int8_activation_convs"):
            raise MnnToolError("the quantiser quantised no convolution or matmul")
    except MnnToolError as exc:
        if exc.forbidden:
            raise ConversionFailed(str(exc), tool="mnnquant", output_tail=exc.output[-2000:]) from exc
        full_failed = f"{exc}: {_cause(exc.output)}" if exc.output else str(exc)
    else:
        details.update(convert_flags=flags, weights=summary, int8={**settings, "calibration_data": label})
        try:
            return _finish(ctx, Precision.INT8, details, warnings, specs=specs, baseline=baseline)
        except ParityFailed as exc:
            full_failed = f"full int8 failed parity: {exc.message}"
    ctx.progress("full int8 not possible; falling back to weight-only int8")
    dst.unlink(missing_ok=True)
    flags, settings = _weight_only_int8(source, dst, scratch)
    summary = model_summary(dst, scratch)
    if summary and not summary["conv_weights"]["int8"]:
        # An int8 artifact with no int8 weight would be an fp32 model under a false label.
        raise ConversionFailed(
            f"MNN quantised no weight to int8: the model has no convolution or matmul with constant weights "
            f"({full_failed})",
            hint="Compile mnn at fp32 or fp16 instead.",
            tool=TOOL,
        )
    details.update(convert_flags=flags, weights=summary, int8={**settings, "full_int8_attempt": full_failed})
    warnings = [
        f"mnn int8 is weight-only (int8 weights, float activations): MNN's full-int8 quantiser could not be used "
        f"({full_failed})"
    ]
    return _finish(ctx, Precision.INT8, details, warnings, specs=specs, baseline=baseline)
