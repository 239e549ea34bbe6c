"""BERT-, GPT-2- and ViT-class models for the optimiser benchmark, random weights, built offline.

Each is exported three ways, as Kiln meets them: torch's TorchScript exporter, torch's dynamo
exporter (both from transformers' models) and tf2onnx from a Keras model of the same shape
(hand-built from Keras layers: keras_hub is not installed). Sizes follow issue 12: hidden
256, 4 layers, 4 heads, sequence 64; ViT on 64x64 images in 8x8 patches. Batch and sequence
stay dynamic, so one file serves batch 1 and batch 8.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

HIDDEN, LAYERS, HEADS, FFN, VOCAB, SEQ = 256, 4, 4, 1024, 1000, 64
IMAGE, PATCH = 64, 8

#: feeds(batch) -> {input name: array}
Feeds = Callable[[int], dict[str, np.ndarray]]


def _token_feeds(mask: bool) -> Feeds:
    def feeds(batch: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(batch)
        out = {"input_ids": rng.integers(0, VOCAB, (batch, SEQ)).astype(np.int64)}
        if mask:
            out["attention_mask"] = np.ones((batch, SEQ), np.int64)
        return out

    return feeds


def _image_feeds(channels_last: bool) -> Feeds:
    def feeds(batch: int) -> dict[str, np.ndarray]:
        shape = (batch, IMAGE, IMAGE, 3) if channels_last else (batch, 3, IMAGE, IMAGE)
        return {"pixel_values": np.random.default_rng(batch).standard_normal(shape).astype(np.float32)}

    return feeds


# --- torch (transformers) -----------------------------------------------------------------


def _torch_module(kind: str) -> Any:
    import torch
    import transformers as tr

    torch.manual_seed(0)

    class LastHidden(torch.nn.Module):
        """Positional inputs (as the exporters pass them) in, last_hidden_state out."""

        def __init__(self, model: Any, names: tuple[str, ...]) -> None:
            super().__init__()
            self.model, self.names = model, names

        def forward(self, first: Any, second: Any = None) -> Any:
            args = (first,) if second is None else (first, second)
            return self.model(**dict(zip(self.names, args, strict=True))).last_hidden_state

    if kind == "bert":
        cfg = tr.BertConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            intermediate_size=FFN,
            max_position_embeddings=128,
        )
        return LastHidden(tr.BertModel(cfg), ("input_ids", "attention_mask")).eval()
    if kind == "gpt2":
        cfg = tr.GPT2Config(
            vocab_size=VOCAB,
            n_embd=HIDDEN,
            n_layer=LAYERS,
            n_head=HEADS,
            n_positions=128,
            bos_token_id=0,
            eos_token_id=0,
        )
        cfg.use_cache = False
        return LastHidden(tr.GPT2Model(cfg), ("input_ids", "attention_mask")).eval()
    cfg = tr.ViTConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=FFN,
        image_size=IMAGE,
        patch_size=PATCH,
    )
    return LastHidden(tr.ViTModel(cfg, add_pooling_layer=False), ("pixel_values",)).eval()


def torch_transformer(
    kind: str, exporter: str, path: Path, *, random_biases: bool = False, reuse: bool = False
) -> tuple[Path, Feeds]:
    """Export transformers' ``kind`` (bert, gpt2, vit) with ``exporter`` (torchscript, dynamo) to ``path``.

    transformers initialises every bias to zero, which optimisers then drop; ``random_biases``
    draws them from U(-0.1, 0.1) as a trained model has them. ``reuse``: an existing ``path`` is
    taken as it is.
    """
    feeds = _image_feeds(False) if kind == "vit" else _token_feeds(True)
    if reuse and path.exists():
        return path, feeds
    import torch

    module = _torch_module(kind)
    if random_biases:
        with torch.no_grad():
            for name, param in module.named_parameters():
                if name.endswith("bias"):
                    param.uniform_(-0.1, 0.1)
    example = {k: torch.from_numpy(v) for k, v in feeds(2).items()}
    names = list(example)
    if exporter == "torchscript":
        axes = {n: {0: "batch"} if kind == "vit" else {0: "batch", 1: "sequence"} for n in names}
        axes["last_hidden_state"] = {0: "batch"} if kind == "vit" else {0: "batch", 1: "sequence"}
        torch.onnx.export(
            module,
            tuple(example.values()),
            str(path),
            input_names=names,
            output_names=["last_hidden_state"],
            dynamic_axes=axes,
            opset_version=17,
            dynamo=False,
        )
    else:
        batch = torch.export.Dim("batch", min=1, max=64)
        dims = {0: batch} if kind == "vit" else {0: batch, 1: torch.export.Dim("sequence", min=2, max=128)}
        program = torch.onnx.export(
            module,
            tuple(example.values()),
            input_names=names,
            output_names=["last_hidden_state"],
            dynamic_shapes=tuple(dims for _ in names),
            dynamo=True,
            optimize=False,
        )
        program.save(str(path))
    return path, feeds


# --- Keras -> tf2onnx ---------------------------------------------------------------------


def _gelu(x: Any) -> Any:
    import keras

    # The tanh form: tf2onnx has no conversion for the Erfc of Keras' exact gelu.
    return keras.activations.gelu(x, approximate=True)


def _keras_block(keras: Any, x: Any, *, causal: bool, pre_norm: bool, mask: Any = None) -> Any:
    layers = keras.layers
    attn = layers.MultiHeadAttention(HEADS, HIDDEN // HEADS)
    if pre_norm:  # GPT-2 / ViT: LayerNorm before each sub-block
        h = layers.LayerNormalization(epsilon=1e-5)(x)
        x = x + attn(h, h, use_causal_mask=causal)
        h = layers.LayerNormalization(epsilon=1e-5)(x)
        return x + layers.Dense(HIDDEN)(layers.Dense(FFN, activation=_gelu)(h))
    # BERT: LayerNorm after each residual Add
    x = layers.LayerNormalization(epsilon=1e-12)(x + attn(x, x, attention_mask=mask))
    return layers.LayerNormalization(epsilon=1e-12)(x + layers.Dense(HIDDEN)(layers.Dense(FFN, activation=_gelu)(x)))


def _keras_model(kind: str) -> Any:
    import keras

    keras.utils.set_random_seed(0)
    layers = keras.layers
    if kind == "vit":
        pixels = keras.Input((IMAGE, IMAGE, 3), name="pixel_values")
        patches = layers.Conv2D(HIDDEN, PATCH, strides=PATCH)(pixels)
        x = layers.Reshape(((IMAGE // PATCH) ** 2, HIDDEN))(patches)
        x = x + layers.Embedding((IMAGE // PATCH) ** 2, HIDDEN)(keras.ops.arange((IMAGE // PATCH) ** 2))
        for _ in range(LAYERS):
            x = _keras_block(keras, x, causal=False, pre_norm=True)
        return keras.Model(pixels, layers.LayerNormalization(epsilon=1e-12)(x))

    class Positions(layers.Layer):
        """Position embeddings for a sequence of any length."""

        def build(self, _: Any) -> None:
            self.table = self.add_weight(shape=(128, HIDDEN), initializer="random_normal")

        def call(self, ids: Any) -> Any:
            return keras.ops.take(self.table, keras.ops.arange(keras.ops.shape(ids)[1]), axis=0)

    ids = keras.Input((None,), dtype="int64", name="input_ids")
    x = layers.Embedding(VOCAB, HIDDEN)(ids) + Positions()(ids)
    inputs = [ids]
    if kind == "bert":
        mask_in = keras.Input((None,), dtype="int64", name="attention_mask")
        inputs.append(mask_in)
        x = layers.LayerNormalization(epsilon=1e-12)(x)
        mask = keras.ops.cast(mask_in[:, None, :], "bool")
        for _ in range(LAYERS):
            x = _keras_block(keras, x, causal=False, pre_norm=False, mask=mask)
        return keras.Model(inputs, x)
    for _ in range(LAYERS):
        x = _keras_block(keras, x, causal=True, pre_norm=True)
    return keras.Model(inputs, layers.LayerNormalization(epsilon=1e-5)(x))


def keras_transformer(kind: str, path: Path, *, reuse: bool = False) -> tuple[Path, Feeds]:
    """Build the Keras ``kind`` (bert, gpt2, vit) and convert it with tf2onnx at opset 17, as Kiln's keras route does.

    ``reuse``: an existing ``path`` is taken as it is.
    """
    feeds = _image_feeds(True) if kind == "vit" else _token_feeds(kind == "bert")
    if reuse and path.exists():
        return path, feeds
    import onnx
    import tensorflow as tf
    import tf2onnx

    model = _keras_model(kind)
    if kind == "vit":
        spec = (tf.TensorSpec((None, IMAGE, IMAGE, 3), tf.float32, name="pixel_values"),)
    else:
        names = ["input_ids", "attention_mask"] if kind == "bert" else ["input_ids"]
        spec = tuple(tf.TensorSpec((None, None), tf.int64, name=n) for n in names)
    proto, _ = tf2onnx.convert.from_keras(model, input_signature=spec, opset=17)
    onnx.save(proto, str(path))
    return path, feeds
