"""Edges into OpenVINO IR: ONNX, TF SavedModel and TFLite read by ``openvino.convert_model``.

Each edge writes ``model.xml`` + ``model.bin`` at full fp32 (``compress_to_fp16=False``;
``ov.save_model`` compresses by default): an edge of the graph is a faithful conversion,
and precision is the exporter's decision. Dynamic axes stay dynamic; the CPU plugin runs
them as they come, and a spec's concrete shapes are for validation, not for the IR.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from services.artifacts import Artifact
from services.errors import ConversionFailed, InvalidSpec, SourceUnreadable, tool_said
from services.formats import Format
from services.steps.context import StepContext

__all__ = ["IR_FILE", "onnx_to_ir", "opt_out_of_telemetry", "save_ir", "savedmodel_to_ir", "tflite_to_ir"]

IR_FILE = "model.xml"
TOOL = "openvino.convert_model"
DEFAULT_SIGNATURE = "serving_default"


def _ov() -> Any:
    import openvino as ov

    opt_out_of_telemetry()
    return ov


_TELEMETRY_OFF = False


def opt_out_of_telemetry() -> None:
    """Keep ``convert_model`` from sending usage events (once per process).

    A compile service must not report its users' conversions to a third party, and the
    events cost: measured 0.19 s per conversion of the tiny CNN against 0.02 s without,
    plus up to 0.8 s of CPU per conversion in the background (docs/benchmarks.md). The
    documented opt-outs are a consent file in the user's home or ``CI=true``; Kiln touches
    neither. ``convert_model`` asks the process-wide Telemetry singleton for app "OVC" and
    re-reads the consent only when another app name set it up, so setting it up as "OVC"
    here and withdrawing consent lasts for every later conversion in this process.
    """
    global _TELEMETRY_OFF
    if _TELEMETRY_OFF:
        return
    _TELEMETRY_OFF = True
    try:
        from openvino.tools.ovc.telemetry_utils import init_ovc_telemetry

        init_ovc_telemetry().consent = False
    except Exception:  # no openvino_telemetry installed (OpenVINO then uses its stub), or a new API
        pass


def _readable_path(ctx: StepContext, source: Any) -> Any:
    """Return ``source``, or when it is a path with a comma, the same file through a comma-free link.

    OpenVINO's converter reads a path string with a comma as a list of files (ovc's
    cli_parser splits it, a pathlib.Path too), so ``/work/a, b/model.onnx`` is "not existing";
    its folder is linked under the step's scratch, keeping the files beside the model
    (external data) next to it.
    """
    if not isinstance(source, (str, Path)) or "," not in str(source):
        return source
    path = Path(source)
    link = ctx.scratch / "ovc-input"
    if not link.exists():
        link.symlink_to(path.parent.resolve(), target_is_directory=True)
    return str(link / path.name)


def _convert(ctx: StepContext, source: Any, label: str) -> Any:
    """Return ``ov.convert_model(source)``; a refusal becomes CONVERSION_FAILED with the tool's message."""
    ov = _ov()
    source = _readable_path(ctx, source)
    ctx.progress(f"converting {label} with {TOOL}")
    try:
        return ov.convert_model(source)
    except Exception as exc:  # OpenVINO's frontends raise OpConversionFailure, GeneralFailure, ...
        text = str(exc)
        raise ConversionFailed(
            f"{TOOL} could not convert {label}: {tool_said(text, exc)}",
            hint="The tail of OpenVINO's message names the operation it cannot read; "
            "another route (e.g. through ONNX) may support it.",
            step=ctx.step.id,
            tool=TOOL,
            output_tail=text[-2000:],
        ) from exc


def save_ir(model: Any, out_dir: Path, *, compress_to_fp16: bool = False) -> Path:
    """Write ``model`` as ``out_dir/model.xml`` + ``model.bin``; return the xml path."""
    xml = out_dir / IR_FILE
    _ov().save_model(model, str(xml), compress_to_fp16=compress_to_fp16)
    return xml


def _describe(model: Any) -> dict[str, Any]:
    from services.runners.openvino import ov_tensor_spec

    ops = Counter(op.get_type_name() for op in model.get_ops())
    return {
        "inputs": [ov_tensor_spec(p, f"input_{i}").to_dict() for i, p in enumerate(model.inputs)],
        "outputs": [ov_tensor_spec(p, f"output_{i}").to_dict() for i, p in enumerate(model.outputs)],
        "ops": dict(sorted(ops.items())),
    }


def _finish(ctx: StepContext, model: Any, source_format: Format, how: str) -> Artifact:
    save_ir(model, ctx.out_dir, compress_to_fp16=False)
    return Artifact(
        root=ctx.out_dir,
        kind=Format.OPENVINO_IR.value,
        entry=IR_FILE,
        meta={
            "tool": TOOL,
            "openvino": _ov().__version__,
            "source_format": source_format.value,
            "read_as": how,
            "compress_to_fp16": False,
            **_describe(model),
        },
    )


def onnx_to_ir(ctx: StepContext) -> Artifact:
    """Convert the step's ONNX model (external data beside it is read too) to fp32 IR."""
    src = ctx.model.path
    model = _convert(ctx, str(src), f"ONNX {src.name}")
    return _finish(ctx, model, Format.ONNX, "ONNX file")


def _signature_function(path: Path, signature: str) -> tuple[Any, Any]:
    """Return the loaded SavedModel and the concrete function of one of its signatures.

    The caller must hold the loaded object while converting: the function only references
    its variables, which TensorFlow deletes with the object.
    """
    import tensorflow as tf

    try:
        loaded = tf.saved_model.load(str(path))
    except Exception as exc:
        raise SourceUnreadable(f"TensorFlow cannot load the SavedModel {path.name}: {exc}") from exc
    sigs = dict(loaded.signatures)
    if signature not in sigs:
        raise InvalidSpec(
            f"the SavedModel has no signature {signature!r}",
            hint=f"Set `signature` to one of: {', '.join(sorted(sigs)) or '(none: re-export with a signature)'}.",
            signatures=sorted(sigs),
        )
    return loaded, sigs[signature]


def savedmodel_to_ir(ctx: StepContext) -> Artifact:
    """Convert the spec's signature of a SavedModel directory to fp32 IR."""
    src = ctx.model.path
    signature = ctx.step.options.get("signature") or ctx.spec.signature
    if signature == DEFAULT_SIGNATURE:
        # OpenVINO's TensorFlow frontend reads serving_default from the directory itself,
        # without building the model in TensorFlow: cheaper and no TF graph execution.
        model = _convert(ctx, str(src), f"SavedModel {src.name} ({signature})")
        how = "SavedModel directory, serving_default"
    else:
        # Other signatures are only reachable through TensorFlow's loader; convert_model
        # accepts the signature's ConcreteFunction directly.
        ctx.progress(f"loading signature {signature!r} with TensorFlow")
        loaded, function = _signature_function(src, signature)
        model = _convert(ctx, function, f"SavedModel {src.name} ({signature})")
        del loaded  # only now may TensorFlow free the variables the function reads
        how = f"SavedModel signature {signature} via tf.saved_model.load"
    art = _finish(ctx, model, Format.SAVEDMODEL, how)
    art.meta["tf_signature"] = signature
    return art


def _signature_names(model: Any, path: Path, wanted: str | None) -> dict[str, str]:
    """Name the IR's inputs and outputs by the TFLite signature the reference ran; return tensor -> signature name.

    OpenVINO's TFLite frontend names them by the file's tensor names
    (``StatefulPartitionedCall:1``) in the subgraph's order, while the reference names them by
    the signature (``note``) in its order. The signature maps each of its names to a tensor, so
    each IR port gets the name of the tensor it is, not of the position it has (basic-pitch's
    subgraph lists onset, note, contour; its signature contour, note, onset).
    """
    from services.formats.tflite import tflite_signatures
    from services.runners.tflite import pick_signature

    signatures = tflite_signatures(path.read_bytes())
    if not signatures:
        return {}
    chosen = signatures[pick_signature(signatures, wanted)]
    renamed: dict[str, str] = {}
    for ports, side in ((model.inputs, chosen["inputs"]), (model.outputs, chosen["outputs"])):
        by_tensor = {tensor: name for name, tensor in side.items()}
        for port in ports:
            hit = next((by_tensor[n] for n in port.get_names() if n in by_tensor), None)
            if hit is not None:
                renamed[port.get_any_name()] = hit
                port.get_tensor().set_names({hit})
    return renamed


def tflite_to_ir(ctx: StepContext) -> Artifact:
    """Convert a .tflite flatbuffer to fp32 IR (OpenVINO's TFLite frontend, no TF needed), its ports named
    by the TFLite signature."""
    src = ctx.model.path
    model = _convert(ctx, str(src), f"TFLite {src.name}")
    renamed = _signature_names(model, src, ctx.step.options.get("signature") or ctx.spec.signature)
    art = _finish(ctx, model, Format.TFLITE, "TFLite flatbuffer")
    if renamed:
        art.meta["tflite_signature_names"] = renamed
    return art
