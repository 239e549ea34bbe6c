"""The architectures people deploy in 2026, as tiny Hugging Face checkpoints with random weights, built offline.

Ten families (issue 30): Llama-style grouped-query attention, Qwen3 with q/k norms, Mistral
with a sliding window, Phi-3, Gemma-2 (soft-capping, alternating sliding layers), ModernBERT
(local and global attention), DeBERTa-v2 (disentangled relative attention), DINOv2, Swin and a
T5 encoder, each built from a ``transformers`` config and written by ``save_pretrained``
(config.json + safetensors), the directory a user uploads. Sizes are tiny (hidden 32, two or
three layers) so the whole matrix of families x engines runs in minutes; the windows are
smaller than the sequences fed, so a sliding window or a local attention really cuts.

transformers starts biases at zero and norm scales at one, which hides a dropped bias or a
swapped scale; :func:`build_checkpoint` draws them as a trained model has them.

:func:`source_outputs` runs the checkpoint with transformers itself (not Kiln's runner), and
:func:`feeds` makes inputs of a given length, so a benchmark can check an artifact against the
source independently of Kiln's parity code.
"""

from __future__ import annotations

__all__ = [
    "FAMILIES",
    "SCORED",
    "Family",
    "build_checkpoint",
    "feeds",
    "source_outputs",
]

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

VOCAB = 128
#: Shared by the decoder families: 4 query heads over 2 key/value heads (grouped-query attention).
_DECODER = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 128,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
#: Sliding windows and local attention spans, shorter than the sequences the matrix feeds.
WINDOW = 8


@dataclass(frozen=True)
class Family:
    """One architecture: how the matrix names it, the task it is compiled for, and its model."""

    key: str
    label: str
    task: str
    #: transformers module -> the model with random weights
    build: Callable[[Any], Any]
    #: "text" (input_ids + attention_mask) or "image" (pixel_values)
    modality: str = "text"
    #: image side (image families)
    image: int = 32


def _llama(tr: Any) -> Any:
    return tr.LlamaForCausalLM(tr.LlamaConfig(**_DECODER))


def _qwen3(tr: Any) -> Any:
    return tr.Qwen3ForCausalLM(tr.Qwen3Config(**_DECODER, head_dim=8))


def _mistral(tr: Any) -> Any:
    return tr.MistralForCausalLM(tr.MistralConfig(**_DECODER, sliding_window=WINDOW))


def _phi3(tr: Any) -> Any:
    return tr.Phi3ForCausalLM(tr.Phi3Config(**_DECODER))


def _gemma2(tr: Any) -> Any:
    return tr.Gemma2ForCausalLM(tr.Gemma2Config(**_DECODER, head_dim=8, sliding_window=WINDOW))


def _modernbert(tr: Any) -> Any:
    config = tr.ModernBertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=3,  # global, local, global
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
        local_attention=WINDOW,
        global_attn_every_n_layers=2,
        num_labels=3,
    )
    return tr.ModernBertForSequenceClassification(config)


def _deberta_v2(tr: Any) -> Any:
    config = tr.DebertaV2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
        relative_attention=True,
        position_buckets=16,
        pos_att_type=["p2c", "c2p"],
        pad_token_id=0,
        num_labels=3,
    )
    return tr.DebertaV2ForSequenceClassification(config)


def _dinov2(tr: Any) -> Any:
    config = tr.Dinov2Config(
        image_size=32,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        mlp_ratio=2,
        num_labels=4,
    )
    return tr.Dinov2ForImageClassification(config)


def _swin(tr: Any) -> Any:
    config = tr.SwinConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4, num_labels=4
    )
    return tr.SwinForImageClassification(config)


def _t5_encoder(tr: Any) -> Any:
    config = tr.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    return tr.T5EncoderModel(config)


#: The rows of the matrix: the ten families at their natural task, then the decoders with past key values.
FAMILIES: tuple[Family, ...] = (
    Family("llama", "Llama-style (GQA)", "causal-lm", _llama),
    Family("qwen3", "Qwen3 (q/k norms)", "causal-lm", _qwen3),
    Family("mistral", "Mistral (sliding window)", "causal-lm", _mistral),
    Family("phi3", "Phi-3", "causal-lm", _phi3),
    Family("gemma2", "Gemma-2 (soft-capping)", "causal-lm", _gemma2),
    Family("modernbert", "ModernBERT", "sequence-classification", _modernbert),
    Family("deberta-v2", "DeBERTa-v2", "sequence-classification", _deberta_v2),
    Family("dinov2", "DINOv2", "image-classification", _dinov2, modality="image"),
    Family("swin", "Swin", "image-classification", _swin, modality="image"),
    Family("t5-encoder", "T5 encoder", "feature-extraction", _t5_encoder),
    Family("llama-past", "Llama-style (GQA) with past", "causal-lm-with-past", _llama),
    Family("qwen3-past", "Qwen3 with past", "causal-lm-with-past", _qwen3),
)
#: The ten families a pass rate counts (one row each, at its natural task).
SCORED: tuple[str, ...] = tuple(f.key for f in FAMILIES[:10])


def family(key: str) -> Family:
    """Return the family called ``key``; KeyError lists the known ones."""
    for f in FAMILIES:
        if f.key == key:
            return f
    raise KeyError(f"no family {key!r}; known: {', '.join(f.key for f in FAMILIES)}")


def _trained_looking(model: Any) -> None:
    """Draw biases from U(-0.1, 0.1) and move norm scales off one, as training leaves them."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.uniform_(-0.1, 0.1)
            elif param.ndim == 1 and "norm" in name.lower():
                param.add_(torch.empty_like(param).uniform_(-0.1, 0.1))


def build_checkpoint(fam: Family, dest: Path, seed: int = 0) -> Path:
    """Write ``fam``'s checkpoint directory (config.json + model.safetensors) under ``dest``; return it."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(seed)
    model = fam.build(transformers).eval()
    _trained_looking(model)
    path = dest / fam.key
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def _kv_geometry(model: Any) -> tuple[int, int, int]:
    config = model.config
    heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    return heads, head_dim, int(config.num_hidden_layers)


def feeds(fam: Family, path: Path, *, sequence: int = 12, past: int = 5, seed: int = 1) -> dict[str, np.ndarray]:
    """Return one batch-1 sample for ``fam``: token ids of length ``sequence`` (a padded tail in the mask for
    encoders, so padding semantics are checked), images of the config's size, random past keys and values."""
    rng = np.random.default_rng(seed)
    if fam.modality == "image":
        return {"pixel_values": rng.standard_normal((1, 3, fam.image, fam.image)).astype(np.float32)}
    ids = rng.integers(3, VOCAB, (1, sequence)).astype(np.int64)
    if fam.task == "causal-lm-with-past":
        import json

        config = json.loads((path / "config.json").read_text())
        heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
        out = {"input_ids": ids}
        for i in range(int(config["num_hidden_layers"])):
            for kind in ("key", "value"):
                out[f"past_key_values.{i}.{kind}"] = rng.standard_normal((1, heads, past, head_dim)).astype(np.float32)
        return out
    mask = np.ones((1, sequence), np.int64)
    if fam.task in ("sequence-classification", "feature-extraction"):
        mask[:, sequence - 3 :] = 0  # a padded tail: the model must ignore it
    return {"input_ids": ids, "attention_mask": mask}


def source_outputs(fam: Family, path: Path, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run the checkpoint with transformers itself (eager attention, fp32) and return its named outputs."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    auto = {
        "causal-lm": transformers.AutoModelForCausalLM,
        "causal-lm-with-past": transformers.AutoModelForCausalLM,
        "sequence-classification": transformers.AutoModelForSequenceClassification,
        "image-classification": transformers.AutoModelForImageClassification,
    }
    if fam.task == "feature-extraction":
        cls: Any = transformers.T5EncoderModel if fam.key == "t5-encoder" else transformers.AutoModel
    else:
        cls = auto[fam.task]
    model = cls.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()
    tensors = {k: torch.from_numpy(v) for k, v in feed.items()}
    with torch.no_grad():
        if fam.task == "causal-lm-with-past":
            cache = transformers.DynamicCache(config=model.config)
            _, _, layers = _kv_geometry(model)
            for i in range(layers):
                cache.update(tensors[f"past_key_values.{i}.key"], tensors[f"past_key_values.{i}.value"], i)
            out = model(input_ids=tensors["input_ids"], past_key_values=cache, use_cache=True, return_dict=True)
            result = {"logits": out.logits.numpy()}
            for i, layer in enumerate(out.past_key_values.layers):
                result[f"present.{i}.key"] = layer.keys.numpy()
                result[f"present.{i}.value"] = layer.values.numpy()
            return result
        kwargs: dict[str, Any] = {"return_dict": True}
        if fam.task == "causal-lm":
            kwargs["use_cache"] = False
        out = model(**tensors, **kwargs)
        key = "last_hidden_state" if fam.task == "feature-extraction" else "logits"
        return {key: getattr(out, key).numpy()}
