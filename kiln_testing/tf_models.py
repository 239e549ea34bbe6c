"""Tiny Keras / TensorFlow models for the TensorFlow-family tests, built with random weights.

Builders write into a directory shared by the whole test session and skip the work when the
file is already there, so every test module can ask for the same model and it is built once
(MobileNetV2 takes seconds). Nothing is downloaded.
"""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

IMAGE = (16, 16, 3)
MOBILENET_SHAPE = (96, 96, 3)


def _keras():
    import keras

    keras.utils.set_random_seed(0)
    return keras


def set_bn_statistics(model, seed: int = 0) -> None:
    """Give every BatchNormalization layer non-trivial gamma, beta, moving mean and variance."""
    keras = _keras()
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            n = layer.gamma.shape[0]
            layer.set_weights(
                [
                    rng.uniform(0.5, 1.5, n).astype("float32"),
                    rng.uniform(-0.2, 0.2, n).astype("float32"),
                    rng.uniform(-0.5, 0.5, n).astype("float32"),
                    rng.uniform(0.5, 2.0, n).astype("float32"),
                ]
            )


def keras_cnn(path: Path) -> Path:
    """Conv2D, BatchNormalization (non-trivial statistics), ReLU, pooling, Dense: 10 logits from 16x16x3 'image'."""
    if path.exists():
        return path
    keras = _keras()
    inp = keras.Input(IMAGE, name="image")
    x = keras.layers.Conv2D(8, 3, padding="same")(inp)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Conv2D(16, 3, padding="same")(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    model = keras.Model(inp, keras.layers.Dense(10, name="logits")(x))
    set_bn_statistics(model)
    model.save(path)
    return path


def keras_normalized(path: Path) -> Path:
    """A CNN behind Normalization(mean, variance) and Rescaling layers, whose constants tf2onnx once made inputs."""
    if path.exists():
        return path
    keras = _keras()
    inp = keras.Input(IMAGE, name="image")
    x = keras.layers.Normalization(mean=[0.4, 0.5, 0.6], variance=[0.04, 0.05, 0.06])(inp)
    x = keras.layers.Rescaling(0.5, offset=0.1)(x)
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    keras.Model(inp, keras.layers.Dense(10, name="logits")(x)).save(path)
    return path


def keras_grouped_conv(path: Path) -> Path:
    """A CNN with a grouped Conv2D, which Keras 3 runs as an XLA-compiled function (a StatefulPartitionedCall)."""
    if path.exists():
        return path
    keras = _keras()
    inp = keras.Input(IMAGE, name="image")
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(inp)
    x = keras.layers.Conv2D(8, 3, padding="same", groups=2)(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    keras.Model(inp, keras.layers.Dense(10, name="logits")(x)).save(path)
    return path


def keras_gelu_mlp(path: Path) -> Path:
    """Dense, exact GELU (TensorFlow computes it with Erfc, as in ConvNeXt), Dense: 4 logits from 8 features."""
    if path.exists():
        return path
    keras = _keras()
    inp = keras.Input((8,), name="features")
    x = keras.layers.Activation("gelu")(keras.layers.Dense(16)(inp))
    keras.Model(inp, keras.layers.Dense(4, name="logits")(x)).save(path)
    return path


def keras_two_inputs(path: Path) -> Path:
    """A functional model with two named inputs (features [N,8], extra [N,4]) and two named outputs."""
    if path.exists():
        return path
    keras = _keras()
    features = keras.Input((8,), name="features")
    extra = keras.Input((4,), name="extra")
    hidden = keras.layers.Dense(16, activation="relu")(features)
    x = keras.layers.Concatenate()([hidden, keras.layers.Dense(8)(extra)])
    x = keras.layers.BatchNormalization()(x)
    outputs = {
        "score": keras.layers.Dense(3, name="score")(x),
        "prob": keras.layers.Dense(5, activation="softmax", name="prob")(x),
    }
    model = keras.Model({"features": features, "extra": extra}, outputs)
    set_bn_statistics(model, seed=1)
    model.save(path)
    return path


def keras_mlp(path: Path) -> Path:
    """Dense 64 -> 512 -> 512 -> 10 with BatchNormalization: ~300k weights, so weight storage dominates file size."""
    if path.exists():
        return path
    keras = _keras()
    inp = keras.Input((64,), name="x")
    x = keras.layers.Dense(512, activation="relu")(inp)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Dense(512, activation="relu")(x)
    model = keras.Model(inp, keras.layers.Dense(10, name="logits")(x))
    set_bn_statistics(model, seed=2)
    model.save(path)
    return path


def mobilenet_v2(path: Path) -> Path:
    """keras.applications.MobileNetV2(weights=None) on 96x96x3, 10 classes.

    Freshly initialised, its activations shrink to ~1e-11 by the last block (unit BatchNorm
    statistics), which would make every output equal and parity meaningless. One forward pass
    in training mode with momentum 0 sets each BatchNorm's moving statistics to those of a
    batch of random images, so activations keep their scale, as in a trained network.
    """
    if path.exists():
        return path
    keras = _keras()
    model = keras.applications.MobileNetV2(weights=None, input_shape=MOBILENET_SHAPE, classes=10)
    norms = [la for la in model.layers if isinstance(la, keras.layers.BatchNormalization)]
    batch = np.random.default_rng(3).standard_normal((16, *MOBILENET_SHAPE)).astype("float32")
    for layer in norms:
        layer.momentum = 0.0
    model(batch, training=True)
    for layer in norms:
        layer.momentum = 0.999
    model.save(path)
    return path


def input_name(keras_path: Path) -> str:
    """Return the input name a saved single-input Keras model declares (its InputLayer's name)."""
    import json
    import zipfile

    config = json.loads(zipfile.ZipFile(keras_path).read("config.json"))
    return next(la["config"]["name"] for la in config["config"]["layers"] if la["class_name"] == "InputLayer")


def image_calibration(path: Path, name: str, shape: tuple[int, ...], n: int = 16, seed: int = 7) -> Path:
    """Write an .npz of ``n`` random samples keyed by ``name``."""
    rng = np.random.default_rng(seed)
    np.savez(path, **{name: rng.standard_normal((n, *shape)).astype(np.float32)})
    return path


def savedmodel_two_signatures(path: Path) -> Path:
    """A SavedModel (dense layer on [N,6] 'x') with signatures serving_default (y = xW+b) and 'doubled' (2y)."""
    if path.exists():
        return path
    import tensorflow as tf

    rng = np.random.default_rng(5)

    class Net(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = tf.Variable(rng.standard_normal((6, 4)).astype("float32"))
            self.b = tf.Variable(rng.standard_normal(4).astype("float32"))

        @tf.function(input_signature=[tf.TensorSpec([None, 6], tf.float32, name="x")])
        def serve(self, x):
            return {"y": tf.matmul(x, self.w) + self.b}

        @tf.function(input_signature=[tf.TensorSpec([None, 6], tf.float32, name="x")])
        def doubled(self, x):
            return {"y": 2.0 * (tf.matmul(x, self.w) + self.b)}

    net = Net()
    tf.saved_model.save(net, str(path), signatures={"serving_default": net.serve, "doubled": net.doubled})
    return path


def tar_gz(directory: Path, dest: Path) -> Path:
    """Pack ``directory`` into ``dest`` (.tar.gz) under its own name."""
    if not dest.exists():
        with tarfile.open(dest, "w:gz") as tf:
            tf.add(directory, arcname=directory.name)
    return dest


def tflite_from_savedmodel(saved_model: Path, dest: Path) -> Path:
    """Convert a SavedModel's serving_default signature to a float32 .tflite (the user's own file)."""
    if dest.exists():
        return dest
    import tensorflow as tf

    dest.write_bytes(tf.lite.TFLiteConverter.from_saved_model(str(saved_model)).convert())
    return dest


def tflite_without_signature(dest: Path) -> Path:
    """A TF1-style .tflite (y = x @ W on [N,6] 'x') carrying no SignatureDef, as older converters wrote them."""
    if dest.exists():
        return dest
    import tensorflow as tf

    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 6], name="x")
        w = tf.constant(np.random.default_rng(6).standard_normal((6, 3)).astype("float32"))
        y = tf.identity(tf.nn.relu(tf.matmul(x, w)), name="y")
        with tf.compat.v1.Session() as sess:
            dest.write_bytes(tf.compat.v1.lite.TFLiteConverter.from_session(sess, [x], [y]).convert())
    return dest
