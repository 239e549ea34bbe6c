"""ONNX to a serving SavedModel with onnx2tf, keeping the ONNX model's tensor layouts.

Layout: onnx2tf rewrites NCHW graphs to NHWC (TensorFlow's native layout) and by default
expects NHWC inputs. Kiln passes every rank 3-5 input in
``keep_ncw_or_nchw_or_ncdhw_input_names`` so the SavedModel takes exactly the shapes the
ONNX model (and the reference) takes; onnx2tf adds the transpose inside the graph. Its
outputs may still come out channel-last, so after conversion each output is probed against
onnxruntime on one sample and transposed back inside the serving signature when that is
what matches. A caller never has to know that a layout changed.

Offline: onnx2tf fetches sample images from the network in two places, its int8
calibration path (``output_integer_quantized_tflite``, never used here: Kiln quantizes
with TFLite's converter on the job's own data) and an optional dummy-inference check for
small fixed-batch NHWC image inputs. The second is swapped for a seeded local generator
for the duration of the call, so a conversion never touches the network.

onnx2tf overwrites its input file (after shape inference), so it works on a copy.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from services.artifacts import Artifact
from services.errors import ConversionFailed
from services.formats import Format
from services.pipeline.context import StepContext
from services.runners.tensorflow import DEFAULT_SIGNATURE

__all__ = ["onnx_to_savedmodel"]

TOOL = "onnx2tf"
SAVEDMODEL_DIR = "saved_model"


def _offline_sample_images() -> np.ndarray:
    # Same shape as onnx2tf's downloadable sample (20 x 128 x 128 x 3, values in [0, 1]).
    return np.random.default_rng(0).random((20, 128, 128, 3), dtype=np.float32)


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    import onnx2tf.onnx2tf as o2t

    original = o2t.download_test_image_data
    o2t.download_test_image_data = _offline_sample_images
    try:
        yield
    finally:
        o2t.download_test_image_data = original


def _sanitized(name: str) -> str:
    # onnx2tf's own renaming: SavedModel op names may not hold ':' or start with '/'.
    return name.replace(":", "__").lstrip("/")


def _run_onnx2tf(ctx: StepContext, work_onnx: Path, keep_nchw: list[str]) -> Any:
    import onnx2tf

    log = io.StringIO()
    try:
        with _offline(), contextlib.redirect_stdout(log):
            model = onnx2tf.convert(
                input_onnx_file_path=str(work_onnx),
                output_folder_path=str(ctx.scratch / "onnx2tf-out"),
                keep_ncw_or_nchw_or_ncdhw_input_names=keep_nchw or None,
                not_use_onnxsim=True,  # the graph is already optimised; onnxsim is not installed
                disable_model_save=True,  # Kiln writes the SavedModel itself, with named outputs
                non_verbose=True,
            )
    except (Exception, SystemExit) as exc:  # onnx2tf calls sys.exit(1) on some refusals
        tail = (log.getvalue() + "\n" + str(exc)).strip()
        raise ConversionFailed(
            f"{TOOL} could not convert the ONNX model: {type(exc).__name__}: {str(exc).strip()[-300:]}",
            hint="onnx2tf could not map an operator or shape to TensorFlow; "
            "the onnxruntime or openvino targets read this ONNX model directly.",
            step=ctx.step.id,
            tool=TOOL,
            output_tail=tail[-2000:],
        ) from exc
    if model is None:
        raise ConversionFailed(
            f"{TOOL} produced no model", step=ctx.step.id, tool=TOOL, output_tail=log.getvalue()[-2000:]
        )
    return model


def _probe_layouts(
    ctx: StepContext, onnx_path: Path, tf_model: Any, in_names: list[str], out_names: list[str]
) -> list[tuple[int, ...] | None]:
    """Return, per output, the permutation that maps onnx2tf's output back to the ONNX layout."""
    from services.runners.onnx import OnnxRuntimeRunner
    from services.validation.inputs import random_input, resolve_shape

    ort = OnnxRuntimeRunner(onnx_path)
    rng = np.random.default_rng(0)
    feed = {t.name: random_input(t, resolve_shape(t, ctx.spec), rng) for t in ort.inputs}
    expected = ort.run(feed)
    got = tf_model([feed[n] for n in in_names], training=False)
    got_list = [np.asarray(g) for g in (got if isinstance(got, (list, tuple)) else [got])]
    perms: list[tuple[int, ...] | None] = []
    for name, actual in zip(out_names, got_list, strict=True):
        want = expected[name]
        rank = want.ndim
        candidates: list[tuple[int, ...] | None] = [None]
        if rank >= 3:
            # channel-last back to channel-first: (0, r-1, 1, ..., r-2)
            candidates.append((0, rank - 1, *range(1, rank - 1)))
        for perm in candidates:
            arr = actual if perm is None else np.transpose(actual, perm)
            if arr.shape == want.shape and np.allclose(
                arr, want, rtol=1e-3, atol=1e-4 * (1 + float(np.abs(want).max()))
            ):
                perms.append(perm)
                break
        else:
            diff = (
                f"max |diff| {float(np.abs(actual - want).max()):.3g}"
                if actual.shape == want.shape
                else f"shape {list(actual.shape)} vs {list(want.shape)}"
            )
            raise ConversionFailed(
                f"{TOOL}'s TensorFlow graph disagrees with the ONNX model on output {name!r} ({diff})",
                hint="onnx2tf mis-converted an operator; the onnxruntime or openvino targets read the ONNX model directly.",
                step=ctx.step.id,
                tool=TOOL,
            )
    return perms


def onnx_to_savedmodel(ctx: StepContext) -> Artifact:
    """Convert model.onnx to a SavedModel whose serving_default takes the ONNX input layout."""
    import tensorflow as tf

    from services.converters.tensorflow_native import signature_tensors
    from services.onnx_io import load_onnx, save_onnx

    src = ctx.model.path
    work = ctx.scratch / "onnx2tf-in" / "model.onnx"
    work.parent.mkdir(parents=True, exist_ok=True)
    save_onnx(load_onnx(src), work)
    onnx_model = load_onnx(work, load_external_data=False)
    inits = {i.name for i in onnx_model.graph.initializer}
    graph_inputs = [v for v in onnx_model.graph.input if v.name not in inits]
    onnx_in = [v.name for v in graph_inputs]
    onnx_out = [v.name for v in onnx_model.graph.output]
    keep_nchw = [v.name for v in graph_inputs if 3 <= len(v.type.tensor_type.shape.dim) <= 5]

    ctx.progress(f"converting ONNX to TensorFlow with onnx2tf (keeping input layout of {keep_nchw or 'none'})")
    tf_model = _run_onnx2tf(ctx, work, keep_nchw)
    tf_in = [t.name for t in tf_model.inputs]
    perms = _probe_layouts(ctx, src, tf_model, tf_in, onnx_out)

    out_keys = [_sanitized(n) for n in onnx_out]
    signature = [
        tf.TensorSpec(t.shape, t.dtype, name=_sanitized(n)) for t, n in zip(tf_model.inputs, onnx_in, strict=True)
    ]

    def serve(*args: Any) -> dict[str, Any]:
        result = tf_model(list(args), training=False)
        flat = result if isinstance(result, (list, tuple)) else [result]
        return {
            key: (tf.transpose(t, perm) if perm is not None else tf.identity(t))
            for key, t, perm in zip(out_keys, flat, perms, strict=True)
        }

    module = tf.Module()
    module.model = tf_model  # tracked, so its variables are saved with the graph
    concrete = tf.function(serve, input_signature=signature).get_concrete_function()
    dest = ctx.out_dir / SAVEDMODEL_DIR
    tf.saved_model.save(module, str(dest), signatures={DEFAULT_SIGNATURE: concrete})
    return Artifact(
        root=ctx.out_dir,
        kind=Format.SAVEDMODEL.value,
        entry=SAVEDMODEL_DIR,
        meta={
            "tool": TOOL,
            "kept_input_layout": keep_nchw,
            "transposed_outputs": [n for n, p in zip(onnx_out, perms, strict=True) if p is not None],
            "renamed": {n: _sanitized(n) for n in [*onnx_in, *onnx_out] if _sanitized(n) != n},
            "signature": signature_tensors(dest),
        },
    )
