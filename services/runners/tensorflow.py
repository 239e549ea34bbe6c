"""Run Keras models and TF SavedModels with TensorFlow, and the loaders the TF converters share.

Keras files are checked for code payloads before Keras sees them and then loaded in safe
mode. Every Keras model is driven through one serving function whose inputs are named
after the Keras inputs and whose outputs are a dict keyed by the Keras output names, so
the ONNX graph, the SavedModel signature and the TFLite signature all carry the same names
and parity matches tensors by name, never by position.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from services.errors import InvalidSpec, SourceUnreadable, UnsafeInput
from services.formats.keras_safety import UNSAFE_HINT, check_keras_file
from services.runners.base import ModelRunner, TensorSpec
from services.steps.source_memo import memoized

__all__ = [
    "DEFAULT_SIGNATURE",
    "KerasRunner",
    "SavedModelRunner",
    "keras_io",
    "keras_serving_concrete",
    "keras_serving_function",
    "load_keras_model",
    "load_signature",
    "signature_io",
]

DEFAULT_SIGNATURE = "serving_default"


def load_keras_model(path: Path) -> Any:
    """Return the Keras model at ``path``, refusing code payloads first and loading in safe mode.

    Within a job run in one process (``kiln compile``) the steps share one load.
    """
    return memoized("keras", path, lambda: _load_keras_model(path))


def keras_serving_concrete(path: Path) -> tuple[Any, Any]:
    """Return ``(model, traced serving function)`` of a Keras file; one trace per job, as for the load."""

    def trace() -> tuple[Any, Any]:
        import tensorflow as tf

        model = load_keras_model(path)
        fn, signature = keras_serving_function(model)
        return model, tf.function(fn, input_signature=signature).get_concrete_function()

    return memoized("keras-serving", path, trace)


def _load_keras_model(path: Path) -> Any:
    check_keras_file(path)
    import keras

    try:
        return keras.saving.load_model(str(path), safe_mode=True, compile=False)
    except ValueError as exc:
        # Safe mode is the second line of defence: a payload the config walk missed lands here.
        if "safe_mode" in str(exc) or "lambda" in str(exc).lower():
            raise UnsafeInput(f"Keras refused to load {Path(path).name} in safe mode: {exc}", hint=UNSAFE_HINT) from exc
        raise SourceUnreadable(f"Keras cannot load {Path(path).name}: {exc}") from exc
    except TypeError as exc:
        raise SourceUnreadable(
            f"Keras cannot rebuild {Path(path).name}: {exc}",
            hint="Custom layers must be registered and installed in the worker, or submit a SavedModel export.",
        ) from exc
    except OSError as exc:
        raise SourceUnreadable(f"{Path(path).name} is not a readable Keras file: {exc}") from exc


def _dims(shape: Any) -> tuple[int | None, ...]:
    return tuple(None if d is None else int(d) for d in shape)


def _output_names(model: Any) -> list[str]:
    names = getattr(model, "output_names", None)
    if names:
        return list(names)
    if len(model.outputs) == 1:  # Sequential has no output_names; its output is the last layer's
        return [model.layers[-1].name]
    return [f"output_{i}" for i in range(len(model.outputs))]


def keras_io(model: Any) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Return a Keras model's inputs (its Input names) and outputs (its output names)."""
    inputs = [TensorSpec(t.name, str(t.dtype), _dims(t.shape)) for t in model.inputs]
    outputs = [
        TensorSpec(name, str(t.dtype), _dims(t.shape))
        for name, t in zip(_output_names(model), model.outputs, strict=True)
    ]
    return inputs, outputs


def _input_structure(model: Any) -> Any:
    """Return the structure (tensor, list or dict of Keras inputs) the model was built with, if known."""
    try:
        return model.input
    except (AttributeError, ValueError):
        # A Sequential model has no recorded call: it takes its one input as a bare tensor.
        return None


def keras_serving_function(model: Any) -> tuple[Callable[..., dict[str, Any]], list[Any]]:
    """Return ``(fn, input_signature)``: positional named inputs in, a dict of named outputs out.

    Inputs are placed into the model's own input structure by name, so the function never
    depends on the order of ``model.inputs``.
    """
    import keras
    import tensorflow as tf

    inputs, outputs = keras_io(model)
    names = [t.name for t in inputs]
    out_names = [t.name for t in outputs]
    signature = [tf.TensorSpec(t.shape, tf.as_dtype(t.dtype), name=t.name) for t in inputs]
    structure = _input_structure(model)

    def serve(*args: Any) -> dict[str, Any]:
        by_name = dict(zip(names, args, strict=True))
        if structure is not None:
            feed = keras.tree.map_structure(lambda t: by_name[t.name], structure)
        else:
            feed = args[0] if len(args) == 1 else by_name
        result = model(feed, training=False)
        return dict(zip(out_names, keras.tree.flatten(result), strict=True))

    return serve, signature


def load_signature(path: Path, signature: str | None = None) -> tuple[Any, Any]:
    """Return ``(loaded SavedModel, its signature function)``; INVALID_SPEC when the name is absent."""
    import tensorflow as tf

    name = signature or DEFAULT_SIGNATURE
    try:
        loaded = tf.saved_model.load(str(path))
    except (OSError, ValueError, tf.errors.OpError) as exc:
        raise SourceUnreadable(f"TensorFlow cannot load the SavedModel {Path(path).name}: {exc}") from exc
    available = sorted(loaded.signatures.keys())
    if name not in loaded.signatures:
        raise InvalidSpec(
            f"the SavedModel has no signature {name!r}; it has {available or 'none'}",
            hint="Set `signature` in the spec to one of them."
            if available
            else "Export the model with a serving signature.",
            signatures=available,
        )
    return loaded, loaded.signatures[name]


def _spec_dims(spec: Any) -> tuple[int | None, ...]:
    return () if spec.shape.rank is None else _dims(spec.shape.as_list())


def signature_io(fn: Any) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Return a signature function's inputs and outputs as TensorSpecs keyed by signature names."""
    _, kwargs = fn.structured_input_signature
    inputs = [TensorSpec(name, spec.dtype.name, _spec_dims(spec)) for name, spec in kwargs.items()]
    outputs = [TensorSpec(name, spec.dtype.name, _spec_dims(spec)) for name, spec in fn.structured_outputs.items()]
    return inputs, outputs


class KerasRunner(ModelRunner):
    """A Keras model (.keras or .h5) run in inference mode through its traced serving function.

    The trace is the one the SavedModel and ONNX conversions freeze (shared within a job), and
    a graph runs a deep model's batch several times faster than eager Keras (ResNet-50: one
    Python dispatch per layer and op).
    """

    def __init__(self, path: Path, **_: Any) -> None:
        self.model, self._serve = keras_serving_concrete(path)
        self.inputs, self.outputs = keras_io(self.model)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        result = self._serve(*(feeds[t.name] for t in self.inputs))
        return {t.name: np.asarray(result[t.name]) for t in self.outputs}


class SavedModelRunner(ModelRunner):
    """One signature of a TF SavedModel (``serving_default`` unless the options name another)."""

    def __init__(self, path: Path, *, signature: str | None = None, **_: Any) -> None:
        self._loaded, self._fn = load_signature(path, signature)
        self.signature = signature or DEFAULT_SIGNATURE
        self.inputs, self.outputs = signature_io(self._fn)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import tensorflow as tf

        result = self._fn(**{t.name: tf.constant(feeds[t.name]) for t in self.inputs})
        return {t.name: result[t.name].numpy() for t in self.outputs}

    def close(self) -> None:
        self._fn = None
        self._loaded = None
