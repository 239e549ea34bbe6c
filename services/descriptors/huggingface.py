"""Hugging Face checkpoint directories: a source read with transformers on the onnxruntime worker.

A checkpoint is ``config.json`` plus safetensors weights (a folder, or a zip or tar of one).
Detection, vetting and the loadable root live in :mod:`services.formats.huggingface`
(bytes only, no transformers); the runner and the ONNX edge load it with transformers and
torch, which the onnxruntime image carries (its ``torch`` extra). The spec's
``options.huggingface`` picks the task graph; like every source format's options, it is part
of every step's cache key, so one checkpoint compiled for two tasks shares nothing.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from services.descriptors._types import ConverterDescriptor, FormatDescriptor

#: What Kiln compiles a checkpoint for; the names say which head and which inputs/outputs.
Task = Literal[
    "feature-extraction", "sequence-classification", "causal-lm", "causal-lm-with-past", "image-classification"
]


class HuggingFaceOptions(BaseModel):
    """How a Hugging Face checkpoint is compiled (options.huggingface)."""

    model_config = ConfigDict(extra="forbid")

    task: Task | None = Field(
        default=None,
        description="The graph to export; unset: from the config's architectures (a *ForSequenceClassification "
        "is sequence-classification, *ForCausalLM/*LMHeadModel causal-lm, *ForImageClassification "
        "image-classification, anything else feature-extraction). causal-lm-with-past adds past key values.",
    )
    trust_remote_code: bool = Field(
        default=False, description="Always refused (UNSAFE_INPUT): Kiln never runs code shipped with a model."
    )

    @field_validator("trust_remote_code")
    @classmethod
    def _no_remote_code(cls, v: bool) -> bool:
        # Not a ValueError: pydantic lets other exceptions through, so this is UNSAFE_INPUT, not INVALID_SPEC.
        # Imported here: a descriptor module imports only services.descriptors and pydantic when loaded.
        from services.errors import UnsafeInput

        if v:
            raise UnsafeInput(
                "options.huggingface.trust_remote_code is refused: Kiln never runs code shipped with a model",
                hint="Use an architecture transformers ships, or export the model yourself (torch.export .pt2, ONNX).",
            )
        return v


DESCRIPTORS = (
    FormatDescriptor(
        name="huggingface",
        label="Hugging Face checkpoint (config.json + .safetensors: dir/.zip/.tar.gz)",
        runner="services.runners.huggingface:HuggingFaceRunner",
        source_engine="onnxruntime",  # transformers + torch, in the onnxruntime image as for the torch sources
        detect="services.formats.huggingface:sniff",
        detect_archive="services.formats.huggingface:sniff_members",
        # The checkpoint folder inside an upload, vetted (pickles, auto_map, escaping paths) before any job runs.
        loadable="services.formats.huggingface:vetted_root",
        options=HuggingFaceOptions,
    ),
    ConverterDescriptor(
        "huggingface-to-onnx",
        "huggingface",
        "onnx",
        "onnxruntime",
        2.0,
        "services.converters.huggingface_to_onnx:huggingface_to_onnx",
        "transformers + torch.onnx (dynamo)",
    ),
)
