"""Keras to a serving SavedModel, natively (no ONNX round trip), and SavedModel signature facts.

The SavedModel's one ``serving_default`` signature is the same serving function the ONNX
route traces, so inputs keep their Keras names and outputs are keyed by the Keras output
names (``model.export()`` would call a lone output ``output_0``). It is written with
``tf.saved_model.save`` from a root that tracks only the variables the signature reads:
Keras' ``ExportArchive`` (which ``model.export`` uses) stores every variable twice in
Keras 3.15, once as the Keras variable and once as its tf.Variable, doubling the artifact
(18 MB instead of 9 MB for MobileNetV2) and taking longer to write.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.artifacts import Artifact
from services.errors import ConversionFailed, SourceUnreadable
from services.formats import Format
from services.runners.tensorflow import DEFAULT_SIGNATURE
from services.steps.context import StepContext

__all__ = ["SAVEDMODEL_DIR", "keras_to_savedmodel", "signature_tensors", "write_keras_savedmodel"]

#: The artifact's SavedModel lives in a subdirectory so the descriptor file stays outside it.
SAVEDMODEL_DIR = "saved_model"


def write_keras_savedmodel(
    model: Any, dest: Path, signature: str = DEFAULT_SIGNATURE, concrete: Any | None = None
) -> None:
    """Write ``model`` as a SavedModel at ``dest`` with one serving signature (``concrete``, when traced already)."""
    import tensorflow as tf

    from services.runners.tensorflow import keras_serving_function

    if concrete is None:
        fn, input_signature = keras_serving_function(model)
        concrete = tf.function(fn, input_signature=input_signature).get_concrete_function()
    # The root holds only the tf.Variables the signature reads (what ExportArchive tracks as
    # `_all_variables`). Saving the Keras model itself as the root also saves functions that
    # assign to variables, and TFLite's converter then keeps every weight as a mutable
    # resource variable instead of a constant (NaN outputs, failed int8 calibration).
    root = tf.Module()
    root.serving_variables = list(concrete.variables)
    tf.saved_model.save(root, str(dest), signatures={signature: concrete})


def signature_tensors(saved_model_dir: Path, signature: str = DEFAULT_SIGNATURE) -> dict[str, Any]:
    """Return a signature's method and its input/output keys mapped to graph tensor names.

    Read from saved_model.pb as a protobuf, so it costs no graph loading. TF Serving's REST
    and gRPC clients address tensors by these keys; the tensor names are what tools such as
    saved_model_cli show.
    """
    from tensorflow.core.protobuf import saved_model_pb2

    pb = Path(saved_model_dir) / "saved_model.pb"
    proto = saved_model_pb2.SavedModel()
    try:
        proto.ParseFromString(pb.read_bytes())
    except (OSError, ValueError) as exc:
        raise SourceUnreadable(f"cannot read {pb}: {exc}") from exc
    for graph in proto.meta_graphs:
        if signature in graph.signature_def:
            sig = graph.signature_def[signature]
            return {
                "signature": signature,
                "method": sig.method_name,
                "inputs": {k: v.name for k, v in sig.inputs.items()},
                "outputs": {k: v.name for k, v in sig.outputs.items()},
                "tags": list(graph.meta_info_def.tags),
            }
    raise SourceUnreadable(f"{pb} has no signature {signature!r}")


def keras_to_savedmodel(ctx: StepContext) -> Artifact:
    """Write the Keras source as a SavedModel with a ``serving_default`` signature."""
    from services.runners.tensorflow import keras_io, keras_serving_concrete, load_keras_model

    model = load_keras_model(ctx.model.path)  # unsafe or unreadable files fail here, with their own codes
    dest = ctx.out_dir / SAVEDMODEL_DIR
    ctx.progress("exporting the Keras model as a SavedModel (serving_default)")
    try:
        write_keras_savedmodel(model, dest, concrete=keras_serving_concrete(ctx.model.path)[1])
    except Exception as exc:  # TF raises many types while tracing a model into a graph
        raise ConversionFailed(
            f"Keras could not export {ctx.model.path.name} as a SavedModel: {exc}",
            step=ctx.step.id,
            tool="keras export",
            output_tail=str(exc)[-2000:],
        ) from exc
    inputs, outputs = keras_io(model)
    return Artifact(
        root=ctx.out_dir,
        kind=Format.SAVEDMODEL.value,
        entry=SAVEDMODEL_DIR,
        meta={
            "tool": "tf.saved_model.save",
            "signature": signature_tensors(dest),
            "inputs": [t.to_dict() for t in inputs],
            "outputs": [t.to_dict() for t in outputs],
        },
    )
