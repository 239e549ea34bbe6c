"""The onnxruntime target: the optimised model.onnx at fp32, fp16 or int8, served by Triton.

fp16 uses onnxruntime's own float16 converter with fp32 inputs and outputs kept (callers
need not change their feeds); int8 is onnxruntime's static quantisation calibrated on the
job's calibration data (or generated samples, labelled as such in the report), with the
choices of ``options.onnxruntime.int8`` and, where it loses too much, the most sensitive nodes
left in float (services/exporters/ort_int8.py); int4 is
weight-only MatMulNBits (services/exporters/onnx_int4.py), refused when no MatMul qualifies.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from services.artifacts import DESCRIPTOR, Artifact
from services.descriptors.onnxruntime import OnnxRuntimeOptions
from services.errors import AccuracyDropExceeded, ConversionFailed, ParityFailed
from services.exporters._common import (
    accuracy_of,
    accuracy_verdict,
    calibration_feeds,
    calibration_warnings,
    finish_export,
)
from services.exporters.ort_int8 import Judge, evaluation_judge, quantize_int8, quantize_with_exclusion
from services.formats import Format
from services.onnx_io import load_onnx, save_onnx
from services.repository.layouts import OVMS_F32
from services.spec import Precision
from services.steps.context import StepContext
from services.steps.reference import ReferenceData, load_reference

__all__ = ["export_onnxruntime", "quantize_int8", "to_fp16"]  # quantize_int8: services/exporters/ort_int8.py

MODEL_FILE = "model.onnx"
SERVING = {"triton": {"platform": "onnxruntime_onnx"}, "ovms": OVMS_F32}


#: The quantisation ops of an already quantised model, whose float inputs the ONNX spec (before opset
#: 19) or onnxruntime's kernels take in float32 only: a real OCR model's DynamicQuantizeLSTM front made
#: onnxruntime refuse the fp16 graph ("Type 'tensor(float16)' of input parameter ... of operator
#: (DynamicQuantizeLinear) is invalid"). They stay float32, with casts around them.
_FLOAT_ONLY_OPS = [
    "DynamicQuantizeLinear",
    "QuantizeLinear",
    "DequantizeLinear",
    "DynamicQuantizeLSTM",
    "DynamicQuantizeMatMul",
    "MatMulIntegerToFloat",
]


def to_fp16(src: Path, dst: Path, *, drop_shapes: bool = False) -> None:
    """Write an fp16 copy of ``src`` whose inputs and outputs stay fp32.

    ``drop_shapes``: leave out the intermediate shapes the converter infers, as the fusion pass
    did for the fp32 model (they would let onnxruntime fuse SkipLayerNormalization at load).
    """
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    from services.passes.ort_fusions import drop_value_info

    model = load_onnx(src)
    # keep_io_types adds Cast nodes at the boundaries so the public signature is unchanged.
    fp16 = convert_float_to_float16(
        model, keep_io_types=True, disable_shape_infer=False, op_block_list=[*DEFAULT_OP_BLOCK_LIST, *_FLOAT_ONLY_OPS]
    )
    if drop_shapes:
        drop_value_info(fp16)
    save_onnx(fp16, dst)


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


def _accuracy_judge(ctx: StepContext, ref: ReferenceData, model: Path) -> Judge | None:
    """Return the int8 search's judge of an attempt on the spec's labelled data (None without ``evaluation``)."""
    scorer, data = accuracy_of(ctx, ref, search=True), ref.evaluation
    if scorer is None or data is None:
        return None
    from services.validation.evaluation import artifact_output

    outputs = [o.name for o in load_onnx(model, load_external_data=False).graph.output]
    judge = evaluation_judge(data.feeds, artifact_output(data.output, ref.output_names, outputs), scorer)
    return lambda path: accuracy_verdict(judge(path))


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
        ref = load_reference(ctx.reference)
        feeds, label = calibration_feeds(ref)
        ctx.progress(f"quantising to int8 on {len(feeds)} samples ({label})")
        scratch = ctx.scratch / "ort-int8"
        scratch.mkdir(parents=True, exist_ok=True)
        options = ctx.spec.engine_options(OnnxRuntimeOptions).int8
        int8 = quantize_with_exclusion(
            src,
            dst,
            feeds,
            scratch,
            options,
            ctx.spec.tolerances_for(precision),
            progress=ctx.progress,
            probe=ref.inputs[:2],
            accuracy=_accuracy_judge(ctx, ref, src),
        )
        details["int8"] = {**int8, "calibration_data": label}
        warnings = calibration_warnings(label)
        auto = int8.get("auto_exclude")
        if isinstance(auto, dict) and auto.get("left_in_float"):
            searched = ctx.spec.evaluation is not None and ctx.spec.evaluation.accuracy_aware_int8
            lost = "the accuracy or parity bounds" if searched else "the parity bounds on the calibration samples"
            warnings.append(
                f"{len(auto['left_in_float'])} node(s) left in float: quantised they lost {lost} "
                "(engine_details.int8.auto_exclude names them)"
            )
    try:
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
    except (ParityFailed, AccuracyDropExceeded) as exc:
        int8_details = details.get("int8")
        auto = int8_details.get("auto_exclude") if isinstance(int8_details, dict) else None
        if isinstance(auto, dict) and auto.get("needed"):
            tried = ", ".join(_attempt_said(a) for a in auto["attempts"])
            exc.message += f"; leaving the most sensitive nodes in float did not reach the bounds ({tried})"
            exc.details["int8"] = details["int8"]
        raise


def _attempt_said(attempt: dict[str, object]) -> str:
    """Return one auto_exclude attempt as the failure message lists it."""
    said = f"{attempt.get('tried', 'as asked')} ({attempt['excluded']} in float): SNR {attempt['worst_snr_db']} dB"
    if "drop" in attempt:
        said += f", {attempt['metric']} drop {attempt['drop']}"
    return said
