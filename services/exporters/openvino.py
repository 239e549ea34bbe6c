"""The openvino target: model.xml + model.bin at fp32, fp16 or int8, served by OVMS or Triton.

- fp32: the converted IR, re-saved uncompressed (so a submitted IR gets the repository's
  file names and nothing else changes).
- fp16: ``ov.save_model(..., compress_to_fp16=True)``: weights stored as fp16 with
  decompression nodes; inputs, outputs and activations stay fp32.
- int8: NNCF post-training quantisation of the IR, calibrated on the job's calibration
  file or, when none was given, on generated samples (labelled as such in the report:
  statistics of random inputs are not the statistics of real data). Models that take
  feature vectors get global min/max activation ranges (see ``activation_ranges``).
- int4: NNCF data-free weight compression (``compress_int4``): MatMul weights as i4 with
  one scale per group, activations fp32; refused when no weight could be compressed.

Parity and the benchmark run with ``INFERENCE_PRECISION_HINT=f32``; the runner's module
docstring says why that is the fair setting at every artifact precision.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np

from services.artifacts import Artifact
from services.converters.openvino_ir import IR_FILE, opt_out_of_telemetry, save_ir
from services.errors import ConversionFailed, SourceUnreadable
from services.exporters._common import accuracy_of, calibration_feeds, calibration_warnings, finish_export
from services.formats import Format
from services.repository.layouts import OVMS_F32
from services.spec import Precision
from services.steps.context import StepContext
from services.steps.reference import load_reference
from services.tensors import TensorSpec

__all__ = [
    "PARITY_INFERENCE_PRECISION",
    "SERVING",
    "activation_ranges",
    "compress_int4",
    "count_int4_constants",
    "count_ops",
    "detect_attention",
    "export_openvino",
    "model_items",
    "quantization_arguments",
    "quantize_int8",
    "quiet_nncf",
]

# Triton's OpenVINO backend fixes the model's batch at max_batch_size (ov::set_batch) and
# refuses smaller requests without padding, so Kiln leaves batching off there and keeps the
# model's own dynamic batch axis in dims. Its only precision parameter is HINT_BF16=YES:
# nothing pins f32, so the engine details say so.
SERVING = {"triton": {"backend": "openvino", "batching": False}, "ovms": OVMS_F32}
PARITY_INFERENCE_PRECISION = "f32"

#: Ops that are attention by definition (OpenVINO fuses or imports them from newer opsets).
_ATTENTION_OPS = {"ScaledDotProductAttention", "MultiHeadAttention", "PagedAttentionExtension"}
#: NNCF's own default: statistics settle well before 300 samples, and each one costs a run.
_MAX_CALIBRATION_SAMPLES = 300
#: How far past a Softmax to look for the MatMul that applies attention weights to values;
#: a Convert, Reshape or dropout-free Multiply may sit between them.
_ATTENTION_HOPS = 3


def count_ops(model: Any) -> dict[str, int]:
    """Return how many ops of each type an ``ov.Model`` holds."""
    return dict(sorted(Counter(op.get_type_name() for op in model.get_ops()).items()))


def _feeds_matmul(node: Any, hops: int) -> bool:
    frontier = [node]
    for _ in range(hops):
        nxt = []
        for n in frontier:
            for out in n.outputs():
                for consumer in out.get_target_inputs():
                    c = consumer.get_node()
                    if c.get_type_name() == "MatMul":
                        return True
                    nxt.append(c)
        frontier = nxt
    return False


def detect_attention(model: Any) -> bool:
    """Return True when the model has attention: an attention op, or Softmax feeding a MatMul."""
    for op in model.get_ops():
        kind = op.get_type_name()
        if kind in _ATTENTION_OPS:
            return True
        if kind == "Softmax" and _feeds_matmul(op, _ATTENTION_HOPS):
            return True
    return False


def _ordered(feed: dict[str, np.ndarray], names: list[str], dtypes: list[str]) -> list[np.ndarray]:
    # The reference's input names are the source model's; a converter may rename them
    # (TFLite's "serving_default_x:0"), so fall back to position, as parity does.
    if set(names) == set(feed):
        arrays = [feed[n] for n in names]
    elif len(names) == len(feed):
        arrays = list(feed.values())
    else:
        raise ConversionFailed(
            f"calibration samples carry inputs {sorted(feed)}, the IR takes {names}",
            tool="nncf.quantize",
        )
    return [
        a.astype(d) if d not in ("str", "bfloat16") and a.dtype != np.dtype(d) else a
        for a, d in zip(arrays, dtypes, strict=True)
    ]


@contextlib.contextmanager
def quiet_nncf() -> Iterator[None]:
    """Keep NNCF's INFO lines and progress bars off stdout (the CLI's --json output goes there)."""
    import nncf  # noqa: F401 - configures the "nncf" logger on import

    logger = logging.getLogger("nncf")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        logger.setLevel(level)


def activation_ranges(specs: list[TensorSpec], attention: bool) -> str:
    """Return how NNCF should estimate activation ranges: "minmax" or NNCF's "default".

    NNCF's default for per-tensor activations averages each calibration sample's own min and
    max (MEAN_MINMAX), which resists outliers when a sample is a large activation map. When a
    model takes feature vectors ([batch, features]) its activations are short vectors too, and
    the extremes of a few dozen values underestimate the range the next sample reaches:
    parity samples get clipped. Measured on the tests' two-input Keras model (18 calibration
    rows, 6 held out): cosine on "score" 0.980 with the default, 0.996 with global min/max
    ("prob" 0.990 -> 0.9995, its top-1 67% -> 100%); 96 rows: 0.983 -> 0.9997. Image and
    sequence models keep the default (MobileNetV2 and the tests' CNN measured the same within
    noise either way); transformers keep NNCF's transformer scheme untouched.
    """
    vectors = any(len(s.shape) <= 2 and s.dtype.startswith("float") for s in specs)
    return "minmax" if vectors and not attention else "default"


def model_items(model: Any, feeds: list[dict[str, np.ndarray]]) -> list[list[np.ndarray]]:
    """Return ``feeds`` as NNCF's data items for ``model``: its inputs' arrays in its order, in its dtypes."""
    from services.runners.openvino import ov_tensor_spec

    specs = [ov_tensor_spec(p, f"input_{i}") for i, p in enumerate(model.inputs)]
    names, dtypes = [s.name for s in specs], [s.dtype for s in specs]
    return [_ordered(feed, names, dtypes) for feed in feeds]


def quantize_int8(model: Any, feeds: list[dict[str, np.ndarray]]) -> tuple[Any, dict[str, Any]]:
    """Return ``model`` quantised to int8 by NNCF on ``feeds``, and the settings used."""
    import nncf

    items, arguments, settings = quantization_arguments(model, feeds)
    with quiet_nncf():
        quantized = nncf.quantize(model, nncf.Dataset(items), **arguments)
    return quantized, settings


def quantization_arguments(
    model: Any, feeds: list[dict[str, np.ndarray]]
) -> tuple[list[list[np.ndarray]], dict[str, Any], dict[str, Any]]:
    """Return NNCF's calibration items for ``model``, the keyword arguments Kiln quantises with, and their record.

    The arguments are those :func:`nncf.quantize` and :func:`nncf.quantize_with_accuracy_control`
    share (the latter names ``advanced_parameters`` ``advanced_quantization_parameters``).
    """
    opt_out_of_telemetry()  # NNCF reports through OpenVINO's telemetry too; this may be the process's first use
    import nncf
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters
    from nncf.quantization.range_estimator import RangeEstimatorParametersSet

    from services.runners.openvino import ov_tensor_spec

    specs = [ov_tensor_spec(p, f"input_{i}") for i, p in enumerate(model.inputs)]
    items = model_items(model, feeds)
    attention = detect_attention(model)
    ranges = activation_ranges(specs, attention)
    advanced = None
    if ranges == "minmax":
        advanced = AdvancedQuantizationParameters(activations_range_estimator_params=RangeEstimatorParametersSet.MINMAX)
    # Transformers: ModelType.TRANSFORMER adds NNCF's transformer ignored patterns (around
    # Softmax, LayerNorm and the attention MatMuls) and SmoothQuant on MatMul inputs, whose
    # outlier channels otherwise ruin per-tensor int8 scales; the MIXED preset makes
    # activations asymmetric, since GELU/LayerNorm outputs are not centred on zero.
    # CNNs: PERFORMANCE (symmetric everywhere, NNCF's default) needs no zero points in the
    # int8 kernels, and post-ReLU activations lose nothing to a symmetric range.
    model_type = nncf.ModelType.TRANSFORMER if attention else None
    preset = nncf.QuantizationPreset.MIXED if attention else nncf.QuantizationPreset.PERFORMANCE
    arguments = {
        "preset": preset,
        "model_type": model_type,
        "subset_size": min(len(items), _MAX_CALIBRATION_SAMPLES),
        "target_device": nncf.TargetDevice.CPU,
        "advanced_parameters": advanced,
    }
    settings = {
        "tool": "nncf.quantize",
        "nncf": nncf.__version__,
        "attention_detected": attention,
        "model_type": "transformer" if attention else "default",
        "preset": preset.value,
        "activation_ranges": "global min/max" if ranges == "minmax" else "NNCF default (mean of per-sample min/max)",
        "target_device": "CPU",
        "samples_given": len(items),
        "subset_size": min(len(items), _MAX_CALIBRATION_SAMPLES),
    }
    return items, arguments, settings


#: One scale per 32 weights along the input channel, as the onnxruntime target's MatMulNBits
#: blocks (services/exporters/onnx_int4.py says why 32 and not NNCF's default 128).
INT4_GROUP_SIZE = 32


def count_int4_constants(model: Any) -> int:
    """Return how many constants of an ``ov.Model`` hold 4-bit integers (i4 or u4)."""
    return sum(
        1
        for op in model.get_ops()
        if op.get_type_name() == "Constant" and op.get_output_element_type(0).get_type_name() in ("i4", "u4")
    )


def compress_int4(model: Any) -> tuple[Any, dict[str, Any]]:
    """Return ``model`` with int4 weights by NNCF weight compression (data-free), and the settings used.

    INT4_SYM, one scale per group of ``INT4_GROUP_SIZE``. Weights whose input channels do not
    divide into groups are left as they are (IGNORE), as the onnxruntime target leaves
    MatMuls whose K does not divide into blocks. NNCF's default keeps the embedding and
    the last MatMul at int8 (``all_layers=False``): they hurt accuracy most at 4 bits.
    """
    opt_out_of_telemetry()
    import nncf
    from nncf.quantization.advanced_parameters import AdvancedCompressionParameters, GroupSizeFallbackMode

    with quiet_nncf():
        compressed = nncf.compress_weights(
            model,
            mode=nncf.CompressWeightsMode.INT4_SYM,
            group_size=INT4_GROUP_SIZE,
            ratio=1.0,
            advanced_parameters=AdvancedCompressionParameters(group_size_fallback_mode=GroupSizeFallbackMode.IGNORE),
        )
    settings = {
        "tool": "nncf.compress_weights",
        "nncf": nncf.__version__,
        "mode": "INT4_SYM",
        "group_size": INT4_GROUP_SIZE,
        "ratio": 1.0,
        "backup_mode": "INT8_ASYM (embeddings and the last MatMul)",
        "activations": "float32",
    }
    return compressed, settings


def _read_ir(ctx: StepContext) -> Any:
    import openvino as ov

    src = ctx.model.path
    try:
        return ov.Core().read_model(str(src))
    except Exception as exc:
        raise SourceUnreadable(f"OpenVINO cannot read the IR {src.name}: {exc}") from exc


def export_openvino(ctx: StepContext) -> Artifact:
    """Write model.xml + model.bin at the job's precision, validated and benchmarked on OpenVINO."""
    import openvino as ov

    precision = Precision(ctx.step.options.get("precision", ctx.spec.precision.value))
    model = _read_ir(ctx)
    warnings: list[str] = []
    details: dict[str, Any] = {
        "openvino": ov.__version__,
        "parity_inference_precision": PARITY_INFERENCE_PRECISION,
        "benchmark_inference_precision": PARITY_INFERENCE_PRECISION,
        # Servers compile with the plugin's default unless configured: bf16 on CPUs with
        # AVX512-BF16/AMX, which changes numbers (and speed) beyond what was checked here.
        "serving_note": "OVMS is configured with INFERENCE_PRECISION_HINT f32 (plugin_config in "
        "ovms/config.json). Triton's OpenVINO backend has no f32 setting (only HINT_BF16=YES): it "
        "runs the CPU plugin's default, bf16 on CPUs with AVX512-BF16/AMX, which was not checked here",
    }
    baseline = None
    if precision is not Precision.FP32 and ctx.spec.bench.enabled:
        # The same model at fp32, to time the artifact against (kept out of the artifact).
        baseline_dir = ctx.scratch / "openvino-fp32-baseline"
        baseline_dir.mkdir(parents=True, exist_ok=True)
        save_ir(model, baseline_dir, compress_to_fp16=False)
        baseline = baseline_dir / IR_FILE
    if precision is Precision.FP32:
        save_ir(model, ctx.out_dir, compress_to_fp16=False)
    elif precision is Precision.FP16:
        ctx.progress("saving with fp16-compressed weights")
        save_ir(model, ctx.out_dir, compress_to_fp16=True)
        details["fp16"] = {"compress_to_fp16": True, "weights": "fp16", "activations": "fp32 (f32 inference hint)"}
    elif precision is Precision.INT4:
        ctx.progress(f"compressing weights to int4 with NNCF (group size {INT4_GROUP_SIZE})")
        compressed, settings = compress_int4(model)
        int4 = count_int4_constants(compressed)
        if not int4:
            # An int4 artifact with no int4 weight would be an fp32 model under a false label.
            raise ConversionFailed(
                f"NNCF compressed no weight to int4: the model has no MatMul whose input channels divide into "
                f"groups of {INT4_GROUP_SIZE}",
                hint="int4 is weight-only compression for transformer/LLM MatMuls; compile at fp32, fp16 or int8.",
                tool="nncf.compress_weights",
            )
        save_ir(compressed, ctx.out_dir, compress_to_fp16=False)
        details["int4"] = {**settings, "int4_weight_constants": int4}
    else:
        ref = load_reference(ctx.reference)
        feeds, label = calibration_feeds(ref)
        scorer = accuracy_of(ctx, ref, search=True)
        if scorer is not None and ctx.spec.evaluation is not None:
            from services.exporters.openvino_accuracy import quantize_within_max_drop

            ctx.progress(
                f"quantising to int8 with NNCF on {len(feeds)} samples ({label}), within "
                f"{ctx.spec.evaluation.metric.value} max_drop {ctx.spec.evaluation.max_drop} on the labelled data"
            )
            quantized, settings = quantize_within_max_drop(
                model,
                feeds,
                ref,
                ctx.spec.evaluation,
                scorer,
                ctx.spec.tolerances_for(precision),
                progress=ctx.progress,
            )
        else:
            ctx.progress(f"quantising to int8 with NNCF on {len(feeds)} samples ({label})")
            quantized, settings = quantize_int8(model, feeds)
        ops = count_ops(quantized)
        if not ops.get("FakeQuantize"):
            # An int8 artifact with nothing quantised would be an fp32 model under a false label.
            if "accuracy_control" in settings:
                raise ConversionFailed(
                    "NNCF's accuracy control reverted every int8 operation to float to stay within "
                    f"evaluation.max_drop {ctx.spec.evaluation.max_drop if ctx.spec.evaluation else ''}: "
                    "no int8 artifact keeps that accuracy",
                    hint="Compile at fp16 or fp32, or raise evaluation.max_drop.",
                    tool="nncf.quantize_with_accuracy_control",
                )
            raise ConversionFailed(
                "NNCF inserted no quantisers: the model has no op OpenVINO runs in int8",
                hint="Compile at fp32 or fp16 instead.",
                tool="nncf.quantize",
            )
        save_ir(quantized, ctx.out_dir, compress_to_fp16=False)
        details["int8"] = {**settings, "calibration_data": label, "fake_quantize_ops": ops["FakeQuantize"]}
        warnings = calibration_warnings(label)
    return finish_export(
        ctx,
        fmt=Format.OPENVINO_IR,
        entry=IR_FILE,
        precision=precision,
        serving=SERVING,
        runner_options={"inference_precision": PARITY_INFERENCE_PRECISION},
        engine_details=details,
        warnings=warnings,
        fp32_baseline=baseline,
    )
