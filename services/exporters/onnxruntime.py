"""The onnxruntime target: the optimised model.onnx at fp32, fp16 or int8, served by Triton.

fp16 uses onnxruntime's own float16 converter with fp32 inputs and outputs kept (callers
need not change their feeds); int8 is onnxruntime's static QDQ quantisation calibrated on
the job's calibration data (or generated samples, labelled as such in the report); int4 is
weight-only MatMulNBits (services/exporters/onnx_int4.py), refused when no MatMul qualifies.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from services.artifacts import DESCRIPTOR, Artifact
from services.errors import ConversionFailed
from services.exporters._common import calibration_feeds, calibration_warnings, finish_export
from services.formats import Format
from services.onnx_io import load_onnx, save_onnx
from services.repository.layouts import OVMS_F32
from services.spec import Precision
from services.steps.context import StepContext
from services.steps.reference import load_reference

__all__ = ["export_onnxruntime", "quantize_int8", "to_fp16"]

MODEL_FILE = "model.onnx"
SERVING = {"triton": {"platform": "onnxruntime_onnx"}, "ovms": OVMS_F32}


def to_fp16(src: Path, dst: Path, *, drop_shapes: bool = False) -> None:
    """Write an fp16 copy of ``src`` whose inputs and outputs stay fp32.

    ``drop_shapes``: leave out the intermediate shapes the converter infers, as the fusion pass
    did for the fp32 model (they would let onnxruntime fuse SkipLayerNormalization at load).
    """
    from onnxruntime.transformers.float16 import convert_float_to_float16

    from services.passes.ort_fusions import drop_value_info

    model = load_onnx(src)
    # keep_io_types adds Cast nodes at the boundaries so the public signature is unchanged.
    fp16 = convert_float_to_float16(model, keep_io_types=True, disable_shape_infer=False)
    if drop_shapes:
        drop_value_info(fp16)
    save_onnx(fp16, dst)


class _Feeds:
    """onnxruntime's CalibrationDataReader protocol over a list of feeds."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]) -> None:
        self._it = iter(feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._it, None)

    def rewind(self) -> None:  # pragma: no cover - onnxruntime may call it between passes
        pass


def quantize_int8(src: Path, dst: Path, feeds: list[dict[str, np.ndarray]], scratch: Path) -> dict[str, object]:
    """Quantise ``src`` to int8 QDQ with static calibration on ``feeds``; return the settings used."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    pre = scratch / "preprocessed.onnx"
    quant_pre_process(str(src), str(pre), skip_symbolic_shape=True)
    # MinMax stays the calibration method: measured on held-out rows, the alternatives were no
    # better and some worse. The tests' CNN, transformer block and two-input Keras model gave
    # the same cosine to 1e-5 with Percentile (99.99 / 99.999); CalibMovingAverage (a mean of
    # per-batch extremes) clipped the two-input model's short activation vectors (cosine 0.995
    # -> 0.85); on MobileNetV2 0.35 (five calibration draws) Percentile moved cosine by less
    # than the draw-to-draw spread (MinMax 0.958-0.975). Entropy, through quantize_static,
    # keeps ORT's fixed 128 bins for 128 quantized bins and so reduces to MinMax exactly.
    settings: dict[str, object] = {
        "format": "QDQ",
        "activations": "QUInt8",
        "weights": "QInt8",
        "per_channel": True,
        "calibration_method": "MinMax",
        "samples": len(feeds),
    }
    upgrade = _opset_for_per_channel(pre)
    if upgrade is not None:
        settings["opset_upgrade"] = upgrade
        settings["per_channel"] = upgrade["to"] == PER_CHANNEL_OPSET

    def quantize(extra_options: dict[str, object]) -> None:
        quantize_static(
            str(pre),
            str(dst),
            _Feeds(feeds),
            quant_format=QuantFormat.QDQ,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            per_channel=bool(settings["per_channel"]),
            calibrate_method=CalibrationMethod.MinMax,
            extra_options=extra_options,
        )

    try:
        quantize({})
    except ValueError as exc:
        if "truth value of an array" not in str(exc):
            raise
        # onnxruntime's int32-bias weight-scale adjustment indexes a bias as if it were 1-D; a
        # Gemm bias shaped [1, N] (as Paddle and older exporters write it) makes it compare
        # arrays (measured with onnxruntime 1.32 on PP-OCR models and a one-Gemm graph). Without
        # the adjustment a bias past int32 at the chosen scales is clipped, which the parity gate
        # then sees; the manifest records that it was skipped.
        settings["int32_bias_weight_adjustment"] = "skipped: onnxruntime cannot adjust a bias that is not 1-D"
        quantize({"QDQDisableWeightAdjustForInt32Bias": True})
    return settings


PER_CHANNEL_OPSET = 13  # DequantizeLinear's `axis` (per-channel scales) came in opset 13


def _opset_for_per_channel(path: Path) -> dict[str, object] | None:
    """Upgrade the model at ``path`` in place to opset 13 when it is older; return what was done.

    onnxruntime's quantiser writes per-channel DequantizeLinear nodes with an ``axis`` whatever
    the model's opset, and below opset 13 onnxruntime then refuses the graph it wrote
    (INVALID_GRAPH: "Unrecognized attribute: axis"). When the converter cannot upgrade the
    graph, quantisation stays per-tensor, which every opset accepts.
    """
    from services.errors import KilnError
    from services.passes.opset_upgrade import upgrade_opset

    model = load_onnx(path)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), PER_CHANNEL_OPSET)
    if opset >= PER_CHANNEL_OPSET:
        return None
    try:
        upgraded, _ = upgrade_opset(model, minimum=PER_CHANNEL_OPSET)
    except KilnError as exc:
        return {"from": opset, "to": opset, "why": f"per-tensor weights: the opset could not be upgraded ({exc})"}
    save_onnx(upgraded, path)
    return {"from": opset, "to": PER_CHANNEL_OPSET, "why": "per-channel int8 weights need DequantizeLinear's axis"}


def _write_fp32(src: Path, dst: Path) -> None:
    """Write the fp32 artifact: the input model itself.

    When the input is a lone ``model.onnx`` (what the optimiser writes; its weights inline or
    in ``model.onnx.data``), its files are copied as they are: parsing and re-encoding
    hundreds of MiB of weights changes nothing and costs seconds. Any other layout (a
    source's own file names, other files or folders beside it that external data may point
    into) is loaded and saved.
    """
    data = src.with_name(src.name + ".data")
    others = {
        p.name for p in src.parent.iterdir() if p.is_file() and p.name != DESCRIPTOR and not p.name.startswith(".kiln")
    } - {src.name, data.name}
    nested = any(p.is_dir() for p in src.parent.iterdir())  # external data may live in a subfolder
    if src.name == dst.name and not others and not nested:
        shutil.copyfile(src, dst)
        if data.exists():
            shutil.copyfile(data, dst.with_name(data.name))
        return
    save_onnx(load_onnx(src), dst)


def fuse_transformer_ops(ctx: StepContext, src: Path) -> tuple[Path, dict[str, object]]:
    """Return the model to export (``src`` or its fused copy in scratch) and what the fusion pass did.

    onnxruntime-only rewrites (services/passes/ort_fusions.py): attention and Gelu fusions into
    onnxruntime's contrib ops, and no SkipLayerNormalization. Kept only when the outputs agree
    on generated samples and the result runs faster; the export's parity gate checks it again.
    """
    from services.passes.ort_fusions import fuse_for_onnxruntime
    from services.passes.step import GUARD_MAX_WEIGHT_BYTES, output_check

    data = src.with_name(src.name + ".data")
    if src.stat().st_size + (data.stat().st_size if data.exists() else 0) > GUARD_MAX_WEIGHT_BYTES:
        # Unchecked and untimed it would be a guess; checked, two more sessions cost seconds per GiB.
        return src, {"applied": False, "reason": f"model over {GUARD_MAX_WEIGHT_BYTES >> 20} MiB: not attempted"}
    model = load_onnx(src)
    if sum(len(t.raw_data) or t.ByteSize() for t in model.graph.initializer) > GUARD_MAX_WEIGHT_BYTES:
        # External data under other file names than model.onnx.data: known only once loaded.
        return src, {"applied": False, "reason": f"weights over {GUARD_MAX_WEIGHT_BYTES >> 20} MiB: not attempted"}
    check, unchecked = output_check(model, ctx.spec)
    if check is None:
        return src, {"applied": False, "reason": unchecked}
    ctx.progress("onnxruntime fusions (attention, Gelu; no SkipLayerNormalization)")
    fused, report = fuse_for_onnxruntime(model, check.feeds, check=check)
    ctx.progress(f"onnxruntime fusions: {report['reason']}")
    if fused is model:
        return src, report
    out = ctx.scratch / "ort-fused" / MODEL_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    save_onnx(fused, out)
    return out, report


def export_onnxruntime(ctx: StepContext) -> Artifact:
    """Write model.onnx at the job's precision, validated and benchmarked on onnxruntime."""
    precision = Precision(ctx.step.options.get("precision", ctx.spec.precision.value))
    src = ctx.model.path
    dst = ctx.out_dir / MODEL_FILE
    details: dict[str, object] = {}
    warnings: list[str] = []
    fusion_report: dict[str, object] = {}
    if ctx.spec.optimize and precision in (Precision.FP32, Precision.FP16):
        # fp16 converts the fused fp32 model (onnxruntime's float16 converter handles the
        # contrib ops); fp32 timing baselines then compare like with like.
        src, fusion_report = fuse_transformer_ops(ctx, src)
        details["ort_fusions"] = fusion_report
    if precision is Precision.FP32:
        _write_fp32(src, dst)
    elif precision is Precision.FP16:
        ctx.progress("converting to fp16 (fp32 inputs and outputs kept)")
        dropped = bool(fusion_report.get("applied") and fusion_report.get("value_info_dropped"))
        to_fp16(src, dst, drop_shapes=dropped)
        details["fp16"] = {"keep_io_types": True, "tool": "onnxruntime.transformers.float16"}
    elif precision is Precision.INT4:
        from services.exporters.onnx_int4 import BLOCK_SIZE, quantize_int4

        ctx.progress(f"compressing MatMul weights to int4 (MatMulNBits, block size {BLOCK_SIZE})")
        int4 = quantize_int4(src, dst, BLOCK_SIZE)
        details["int4"] = int4
        if not int4["quantized_matmuls"]:
            # An int4 artifact with no int4 weight would be an fp32 model under a false label.
            raise ConversionFailed(
                f"no MatMul to compress to int4: none has a constant 2-D float weight whose K divides into "
                f"blocks of {BLOCK_SIZE}",
                hint="int4 is weight-only compression for transformer/LLM MatMuls; compile at fp32, fp16 or int8.",
                tool="MatMulNBitsQuantizer",
            )
    else:
        feeds, label = calibration_feeds(load_reference(ctx.reference))
        ctx.progress(f"quantising to int8 on {len(feeds)} samples ({label})")
        scratch = ctx.scratch / "ort-int8"
        scratch.mkdir(parents=True, exist_ok=True)
        details["int8"] = {**quantize_int8(src, dst, feeds, scratch), "calibration_data": label}
        warnings = calibration_warnings(label)
    return finish_export(
        ctx,
        fmt=Format.ONNX,
        entry=MODEL_FILE,
        precision=precision,
        serving=SERVING,
        engine_details=details,
        warnings=warnings,
        fp32_baseline=src,  # the optimised fp32 model this export started from
    )
