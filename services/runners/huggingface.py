"""Run a Hugging Face checkpoint directory with transformers and torch on the CPU.

The directory is vetted and staged first (:mod:`services.formats.huggingface`): transformers
reads a clean copy holding config.json and safetensors weights only, with
``trust_remote_code=False``, ``use_safetensors=True`` and no network. The architecture is one
transformers ships (the config's ``model_type``); the weights must cover it, so a task head
the checkpoint lacks is refused instead of compiled from random initialisation.

The model is wrapped in :class:`TaskGraph`, a module whose forward takes the task's tensors
positionally and returns a tuple of named outputs; the reference run and the ONNX export
(:mod:`services.converters.huggingface_to_onnx`) use the same wrapper, so inputs and
outputs carry the same names on both sides of parity:

=========================  ===============================================  =====================================
task                       inputs                                           outputs
=========================  ===============================================  =====================================
feature-extraction         input_ids, attention_mask[, token_type_ids]      last_hidden_state
                           (vision models: pixel_values)
sequence-classification    input_ids, attention_mask[, token_type_ids]      logits
causal-lm                  input_ids, attention_mask                        logits
causal-lm-with-past        input_ids, past_key_values.<i>.key/.value        logits, present.<i>.key/.value
image-classification       pixel_values                                     logits
=========================  ===============================================  =====================================

Batch and sequence axes (and the past length) are dynamic unless the spec's ``inputs`` pin
them; image sides are the config's ``image_size``. The with-past graph takes no attention
mask: every position of the past and the new tokens is attended (unpadded generation).
"""

from __future__ import annotations

import inspect
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from services.errors import EngineUnavailable, InvalidSpec, SourceUnreadable, UnsafeInput, UnsupportedFormat
from services.formats.huggingface import HuggingFaceCheckpoint, choose_task, stage_checkpoint, vet_checkpoint
from services.runners.base import InputBound, ModelRunner, TensorSpec, contiguous
from services.runners.torch import dynamic_axes_of, torch_dtype_name

if TYPE_CHECKING:
    import torch

    from services.descriptors.huggingface import HuggingFaceOptions
    from services.spec import InputSpec

__all__ = ["HuggingFaceRunner", "load_checkpoint_model"]

#: Example sizes for export and for reading output shapes. torch.export fixes an axis whose
#: example size is 1, and two axes of one example size may be taken as equal: all differ, all >= 2.
EXAMPLE_BATCH, EXAMPLE_SEQUENCE, EXAMPLE_PAST = 2, 7, 5
PROBE_BATCH, PROBE_SEQUENCE, PROBE_PAST = 3, 6, 4


def _auto_class(task: str) -> Any:
    import transformers

    return {
        "feature-extraction": transformers.AutoModel,
        "sequence-classification": transformers.AutoModelForSequenceClassification,
        "causal-lm": transformers.AutoModelForCausalLM,
        "causal-lm-with-past": transformers.AutoModelForCausalLM,
        "image-classification": transformers.AutoModelForImageClassification,
    }[task]


def _encoder_class(ckpt: HuggingFaceCheckpoint) -> Any:
    """Return the encoder-only class of an encoder-decoder family (T5 -> T5EncoderModel), a transformers class."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    base = MODEL_MAPPING_NAMES.get(ckpt.model_type)
    names = [a for a in ckpt.architectures if a.endswith("EncoderModel")]
    if isinstance(base, str):
        names.append(base.removesuffix("Model") + "EncoderModel")
    for name in names:
        cls = getattr(transformers, name, None)
        if (
            isinstance(cls, type)
            and issubclass(cls, transformers.PreTrainedModel)
            and getattr(cls.config_class, "model_type", None) == ckpt.model_type
        ):
            return cls
    raise UnsupportedFormat(
        f"{ckpt.model_type} is an encoder-decoder family with no encoder-only class in transformers",
        hint="Kiln compiles encoder-decoder checkpoints for feature extraction through their encoder "
        "(T5EncoderModel); sequence-to-sequence generation is not supported.",
    )


def load_checkpoint_model(path: Path, task: str | None = None) -> tuple[Any, str, HuggingFaceCheckpoint]:
    """Return (model in eval mode, task, checkpoint): the vetted directory loaded by transformers."""
    ckpt = vet_checkpoint(path)
    try:
        import torch
        import transformers
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    except ImportError as exc:
        raise EngineUnavailable(
            f"cannot read Hugging Face checkpoints here: {exc}",
            hint="Hugging Face checkpoints need torch and transformers (the `torch` extra, in the onnxruntime image).",
        ) from exc
    task = choose_task(ckpt, task)
    if ckpt.model_type not in CONFIG_MAPPING_NAMES:
        raise UnsupportedFormat(
            f"model_type {ckpt.model_type!r} is not an architecture transformers {transformers.__version__} ships",
            hint="Kiln builds only architectures transformers ships (no remote code).",
        )
    # T5EncoderModel saves is_encoder_decoder false, but AutoModel would still build T5Model.
    encoder_only = any(a.endswith("EncoderModel") for a in ckpt.architectures)
    if task == "feature-extraction" and (ckpt.config.get("is_encoder_decoder") or encoder_only):
        cls, safe_kwargs = _encoder_class(ckpt), {}
    else:
        cls, safe_kwargs = _auto_class(task), {"trust_remote_code": False}
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    staged = Path(tempfile.mkdtemp(prefix="kiln-hf-"))
    try:
        stage_checkpoint(ckpt, staged)
        model, info = cls.from_pretrained(
            str(staged),
            local_files_only=True,
            use_safetensors=True,
            output_loading_info=True,
            dtype=torch.float32,
            attn_implementation="eager",
            **safe_kwargs,
        )
    except (UnsafeInput, SourceUnreadable, UnsupportedFormat):
        raise
    except ValueError as exc:  # an architecture without this task's head, a config transformers refuses
        raise UnsupportedFormat(
            f"transformers cannot build {task} for {ckpt.model_type}: {str(exc)[:300]}",
            hint="Give another `options.huggingface.task` in the spec, or check the config.",
        ) from exc
    except OSError as exc:
        raise SourceUnreadable(f"transformers could not read the checkpoint: {str(exc)[:300]}") from exc
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise SourceUnreadable(
            f"the checkpoint has no weights for {len(missing)} parameters of {type(model).__name__} "
            f"({', '.join(missing[:4])}); they would be random",
            hint="Pick the task the checkpoint was trained for (`options.huggingface.task`), or save the full model.",
        )
    model.eval()
    return model, task, ckpt


def _build_graph(model: Any, task: str, input_names: list[str], n_layers: int) -> torch.nn.Module:
    import torch

    class TaskGraph(torch.nn.Module):
        """The model behind a tensors-in, tuple-out forward, as the ONNX graph will be."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
            if task == "causal-lm-with-past":
                from transformers import DynamicCache

                cache = DynamicCache(config=self.model.config)
                for i in range(n_layers):
                    cache.update(args[1 + 2 * i], args[2 + 2 * i], i)
                out = self.model(input_ids=args[0], past_key_values=cache, use_cache=True, return_dict=True)
                present: list[torch.Tensor] = []
                for layer in out.past_key_values.layers:
                    present += [layer.keys, layer.values]
                return (out.logits, *present)
            kwargs = dict(zip(input_names, args, strict=True))
            out = self.model(**kwargs, **no_cache, return_dict=True)
            return (out.last_hidden_state,) if task == "feature-extraction" else (out.logits,)

    # Without past key values there is nothing to return a cache for (and nothing to export).
    no_cache = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    return TaskGraph().eval()


class HuggingFaceRunner(ModelRunner):
    """A vetted Hugging Face checkpoint directory, loaded by transformers, run by torch."""

    def __init__(
        self,
        path: Path,
        *,
        inputs: dict[str, InputSpec] | None = None,
        options: HuggingFaceOptions | None = None,
        **_: Any,
    ) -> None:
        # ``options`` is the spec's options.huggingface (the reference step passes a source format its section).
        if options is not None and options.trust_remote_code:
            raise UnsafeInput("trust_remote_code is refused: Kiln never runs code shipped with a model")
        self.model, self.task, self.checkpoint = load_checkpoint_model(
            Path(path), options.task if options is not None else None
        )
        import torch  # loaded (or ENGINE_UNAVAILABLE raised) by load_checkpoint_model

        config = self.model.config
        self._given = dict(inputs or {})
        main = getattr(self.model, "main_input_name", "input_ids")
        if self.task == "image-classification" or main == "pixel_values":
            if main != "pixel_values":
                raise UnsupportedFormat(f"{self.checkpoint.model_type} takes {main}, not images")
            side = config.image_size
            side = list(side) if isinstance(side, list | tuple) else [side, side]
            self._natural = {"pixel_values": ({0: "batch"}, [config.num_channels, *side], "float32")}
        elif main == "input_ids":
            text = {0: "batch", 1: "sequence"}
            self._natural = {"input_ids": (text, [], "int64")}
            if self.task != "causal-lm-with-past":
                self._natural["attention_mask"] = (text, [], "int64")
            forward = inspect.signature(self.model.forward).parameters
            if "token_type_ids" in forward and int(getattr(config, "type_vocab_size", 0) or 0) > 1:
                self._natural["token_type_ids"] = (text, [], "int64")
        else:
            raise UnsupportedFormat(f"{self.checkpoint.model_type} takes {main}; Kiln compiles text and image models")
        self.n_layers = 0
        if self.task == "causal-lm-with-past":
            heads, head_dim, self.n_layers = self._cache_geometry()
            for i in range(self.n_layers):
                for kind in ("key", "value"):
                    self._natural[f"past_key_values.{i}.{kind}"] = (
                        {0: "batch", 2: "past_sequence"},
                        [heads, head_dim],
                        "float32",
                    )
        unknown = sorted(set(self._given) - set(self._natural))
        if unknown:
            raise InvalidSpec(
                f"spec inputs {unknown} are not inputs of the {self.task} graph; it takes {list(self._natural)}",
                hint="Key `inputs` by the graph's input names (`kiln inspect DIR` lists them).",
            )
        self.graph = _build_graph(self.model, self.task, list(self._natural), self.n_layers)
        self.inputs = [self._tensor_spec(name) for name in self._natural]
        small = self.example_inputs(PROBE_BATCH, PROBE_SEQUENCE, PROBE_PAST)
        large = self.example_inputs()
        with torch.no_grad():
            a, b = self.graph(*small), self.graph(*large)
        self.outputs = [
            TensorSpec(
                name,
                torch_dtype_name(x.dtype),
                tuple(None if dx != dy else int(dx) for dx, dy in zip(x.shape, y.shape, strict=True)),
            )
            for name, x, y in zip(self._output_names(), a, b, strict=True)
        ]

    def _cache_geometry(self) -> tuple[int, int, int]:
        """Return (kv heads, head dim, layers) from one cached forward pass."""
        import torch

        ids = torch.ones((1, 2), dtype=torch.int64)
        with torch.no_grad():
            out = self.model(input_ids=ids, use_cache=True, return_dict=True)
        layers = getattr(out.past_key_values, "layers", None)
        if not layers:
            raise UnsupportedFormat(f"{self.checkpoint.model_type} keeps no key/value cache Kiln can export")
        keys = layers[0].keys
        return int(keys.shape[1]), int(keys.shape[3]), len(layers)

    def _output_names(self) -> list[str]:
        if self.task == "feature-extraction":
            return ["last_hidden_state"]
        names = ["logits"]
        for i in range(self.n_layers):
            names += [f"present.{i}.key", f"present.{i}.value"]
        return names

    def dynamic_axes(self, name: str) -> dict[int, str]:
        """Return the axes of input ``name`` that stay dynamic, with their shared names."""
        axes, fixed, _ = self._natural[name]
        given = self._given.get(name)
        if given is None:
            return dict(axes)
        keep = dynamic_axes_of(given, len(axes) + len(fixed))
        return {a: n for a, n in axes.items() if a in keep}

    def _tensor_spec(self, name: str) -> TensorSpec:
        axes, fixed, dtype = self._natural[name]
        dynamic = self.dynamic_axes(name)
        given = self._given.get(name)
        concrete = given.concrete_shape() if given is not None else None
        rank = len(axes) + len(fixed)
        if concrete is not None and len(concrete) != rank:
            raise InvalidSpec(f"inputs.{name}: shape has rank {len(concrete)}, the graph's input has rank {rank}")
        fill = iter(fixed)
        shape: list[int | None] = []
        for a in range(rank):
            if a in dynamic:
                shape.append(None)
            elif a in axes:  # an axis the spec pinned
                assert concrete is not None
                shape.append(int(concrete[a]))
            else:
                shape.append(int(next(fill)))
        return TensorSpec(name, dtype, tuple(shape))

    def input_bounds(self) -> dict[str, InputBound]:
        config = self.model.config
        bounds = {}
        vocab = int(getattr(config, "vocab_size", 0) or 0)
        if vocab > 0 and "input_ids" in self._natural:
            bounds["input_ids"] = InputBound(vocab, f"config.json's vocab_size ({vocab})")
        types = int(getattr(config, "type_vocab_size", 0) or 0)
        if types > 0 and "token_type_ids" in self._natural:
            bounds["token_type_ids"] = InputBound(types, f"config.json's type_vocab_size ({types})")
        return bounds

    def example_inputs(
        self, batch: int = EXAMPLE_BATCH, sequence: int = EXAMPLE_SEQUENCE, past: int = EXAMPLE_PAST
    ) -> tuple[torch.Tensor, ...]:
        """Return one input per graph input: dynamic axes at the given sizes, pinned ones as the spec says."""
        import torch

        sizes = {"batch": batch, "sequence": sequence, "past_sequence": past}
        vocab = int(getattr(self.model.config, "vocab_size", 16) or 16)
        gen = torch.Generator().manual_seed(0)
        out = []
        for t in self.inputs:
            axes = self._natural[t.name][0]
            shape = [d if d is not None else sizes[axes[a]] for a, d in enumerate(t.shape)]
            if t.name == "input_ids":
                out.append(torch.randint(0, min(vocab, 16), shape, generator=gen))
            elif t.name == "attention_mask":
                out.append(torch.ones(shape, dtype=torch.int64))
            elif t.name == "token_type_ids":
                out.append(torch.zeros(shape, dtype=torch.int64))
            else:
                out.append(torch.randn(shape, generator=gen))
        return tuple(out)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        args = [torch.from_numpy(contiguous(feeds[t.name])) for t in self.inputs]
        with torch.no_grad():
            out = self.graph(*args)
        return {o.name: x.detach().cpu().numpy() for o, x in zip(self.outputs, out, strict=True)}
