"""The tflite target: model.tflite at fp32, fp16 weights or int8, served by OVMS (no Triton backend).

The input is a SavedModel (a Keras source arrives through the keras-to-savedmodel step, the
same one tfserving and openvino use: TensorFlow's converter turns Keras 3 models into a
SavedModel internally anyway, and its Keras entry point cannot calibrate them) converted by
``TFLiteConverter.from_saved_model``, or a .tflite source, published as it is at fp32 only.

int8 comes in two kinds, recorded in the report:

- full-integer int8 when the spec gives calibration data: every op int8, calibrated on the
  reference step's rows of that file. The representative dataset yields dicts keyed by the
  signature's input names, so arrays meet inputs by name, never by position;
- dynamic-range int8 otherwise: int8 weights, float activations. Calibrating on random
  numbers would bake made-up activation ranges into the model, so Kiln does not; the
  artifact carries a warning saying so (manifest, job, CLI summary).

The I/O contract is the same as every other target's: float32 inputs and outputs (the model
quantizes and dequantizes at its boundary), unless the spec sets ``integer_io``, which gives
full-integer int8 inputs and outputs and needs calibration data. The manifest's ``io`` is
read from the .tflite file, so it states the dtypes (and scales) a client really feeds.
"""

from __future__ import annotations

import shutil
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from services.artifacts import Artifact
from services.errors import ConversionFailed, InvalidSpec, tool_said
from services.exporters._common import calibration_feeds, finish_export
from services.formats import Format
from services.repository.layouts import OVMS_F32
from services.runners.tensorflow import DEFAULT_SIGNATURE
from services.spec import Precision
from services.steps.context import StepContext
from services.steps.reference import load_reference

__all__ = ["MODEL_FILE", "convert_savedmodel_to_tflite", "export_tflite", "representative_feeds"]

MODEL_FILE = "model.tflite"
SERVING = {"ovms": OVMS_F32}
TOOL = "tf.lite.TFLiteConverter"


def representative_feeds(
    feeds: list[dict[str, np.ndarray]], signature_inputs: list[str]
) -> list[dict[str, np.ndarray]]:
    """Return calibration samples keyed by the signature's input names, matched by name.

    A name the signature sanitized (``a:0`` → ``a__0``) is matched through the same rule;
    anything else that does not line up is an error naming both sets, never a guess by position.
    """
    if not feeds:
        raise InvalidSpec("int8 calibration needs at least one sample")
    given = list(feeds[0])
    lookup = {name: name for name in given}
    lookup.update({name.replace(":", "__").lstrip("/"): name for name in given})
    missing = [n for n in signature_inputs if n not in lookup]
    if missing:
        raise InvalidSpec(
            f"calibration data has inputs {sorted(given)}, the TFLite signature needs {sorted(signature_inputs)}",
            hint="Key each array of the calibration .npz by the model's input name.",
        )
    return [{n: np.asarray(feed[lookup[n]]) for n in signature_inputs} for feed in feeds]


def _configure(
    converter: Any, precision: Precision, calibration: list[dict[str, np.ndarray]] | None, integer_io: bool
) -> str:
    import tensorflow as tf

    if precision is Precision.FP32:
        return "float32"
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    if precision is Precision.FP16:
        converter.target_spec.supported_types = [tf.float16]
        return "float16 weights"
    if calibration is None:
        return "dynamic-range int8"

    def dataset() -> Iterator[dict[str, np.ndarray]]:
        yield from calibration

    converter.representative_dataset = dataset
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    if integer_io:
        converter.inference_input_type = tf.int8
        converter.inference_output_type = tf.int8
    # Otherwise the converter's default: float32 at the boundary, quantized inside.
    return "full-integer int8"


def convert_savedmodel_to_tflite(
    saved_model: Path,
    dst: Path,
    *,
    signature: str = DEFAULT_SIGNATURE,
    precision: Precision = Precision.FP32,
    calibration: list[dict[str, np.ndarray]] | None = None,
    integer_io: bool = False,
) -> dict[str, Any]:
    """Write ``dst`` from one signature of a SavedModel; return what was done.

    ``calibration`` (samples keyed by signature input name) selects full-integer int8;
    without it int8 means dynamic range. ``integer_io`` (full-integer only) makes the
    inputs and outputs int8; otherwise they stay float32.
    """
    import tensorflow as tf

    converter = tf.lite.TFLiteConverter.from_saved_model(str(saved_model), signature_keys=[signature])
    mode = _configure(converter, precision, calibration, integer_io)
    full_integer = mode == "full-integer int8"
    started = time.perf_counter()
    with warnings.catch_warnings():
        # The calibrator itself builds tf.lite.Interpreter, which warns about its own deprecation.
        warnings.filterwarnings("ignore", message=".*tf.lite.Interpreter is deprecated.*")
        dst.write_bytes(converter.convert())
    return {
        "mode": mode,
        "io_contract": "int8 inputs and outputs" if full_integer and integer_io else "float32 inputs and outputs",
        "signature": signature,
        "convert_seconds": round(time.perf_counter() - started, 3),
    }


def _signature_for(ctx: StepContext) -> str:
    """Return the signature to convert: the spec's for a user's SavedModel, serving_default for Kiln's own."""
    from_source = ctx.step.inputs.get("model") == "source"
    return ctx.spec.signature if from_source else DEFAULT_SIGNATURE


def export_tflite(ctx: StepContext) -> Artifact:
    """Write model.tflite at the job's precision, validated and benchmarked on LiteRT."""
    from services.converters.tensorflow_native import signature_tensors

    precision = Precision(ctx.step.options.get("precision", ctx.spec.precision.value))
    dst = ctx.out_dir / MODEL_FILE
    details: dict[str, Any] = {"converter": TOOL}
    warnings: list[str] = []
    integer_io = ctx.spec.integer_io and precision is Precision.INT8
    if integer_io and not ctx.spec.calibration:
        raise InvalidSpec(
            "integer_io needs calibration data: int8 inputs and outputs take their scales from it",
            hint="Give `calibration` (an .npz of real inputs keyed by input name), or leave integer_io false.",
            errors=[{"field": "integer_io", "problem": "needs calibration"}],
        )
    if Format(ctx.model.kind) is Format.TFLITE:
        shutil.copyfile(ctx.model.path, dst)
        details.update(mode="float32 (the source .tflite, unchanged)", io_contract="the source's", signature=None)
    else:
        saved_model, signature = ctx.model.path, _signature_for(ctx)
        calibration = None
        if precision is Precision.INT8 and ctx.spec.calibration:
            feeds, label = calibration_feeds(load_reference(ctx.reference))
            names = list(signature_tensors(saved_model, signature)["inputs"])
            calibration = representative_feeds(feeds, names)
            details["calibration_data"] = label
            details["calibration_samples"] = len(calibration)
        elif precision is Precision.INT8:
            warnings.append(
                "no calibration data: TFLite int8 fell back to dynamic-range int8 (int8 weights, float "
                "activations); give `calibration` for full-integer int8"
            )
        ctx.progress(f"converting to TFLite ({precision.value})")
        try:
            details.update(
                convert_savedmodel_to_tflite(
                    saved_model,
                    dst,
                    signature=signature,
                    precision=precision,
                    calibration=calibration,
                    integer_io=integer_io,
                )
            )
        except Exception as exc:  # the MLIR converter raises ConverterError, RuntimeError, ValueError
            text = str(exc).strip()
            hint = "The converter names the operation it cannot lower."
            if calibration is not None:
                hint += " Full-integer int8 needs an int8 kernel for every op; without calibration data Kiln builds dynamic-range int8."
            raise ConversionFailed(
                f"the TFLite converter failed at {precision.value}: {tool_said(text, exc)}",
                hint=hint,
                step=ctx.step.id,
                tool=TOOL,
                output_tail=text[-2000:],
            ) from exc
    details["size_bytes"] = dst.stat().st_size
    runner_options = {"signature": details["signature"]} if details.get("signature") else {}
    details["quantized_io"] = _quantized_io(dst, runner_options)
    return finish_export(
        ctx,
        fmt=Format.TFLITE,
        entry=MODEL_FILE,
        precision=precision,
        serving=SERVING,
        runner_options=runner_options,
        engine_details={"tflite": details},
        warnings=warnings,
    )


def _quantized_io(path: Path, runner_options: dict[str, Any]) -> dict[str, list[str]]:
    """Return which inputs/outputs are stored as scaled integers (the runner converts them)."""
    from services.runners.tflite import TFLiteRunner

    runner = TFLiteRunner(path, **runner_options)
    try:
        return runner.quantized_io
    finally:
        runner.close()
