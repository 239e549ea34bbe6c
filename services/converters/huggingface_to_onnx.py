"""Hugging Face checkpoint directories to ONNX with torch's dynamo exporter.

The checkpoint is loaded by :class:`services.runners.huggingface.HuggingFaceRunner` (vetted,
safetensors only, no remote code) and its task graph exported with
``torch.onnx.export(dynamo=True)`` (``torch.export`` underneath): the same module, input and
output names the reference step ran, so parity pairs outputs by name. Batch, sequence and
past-length axes are exported dynamic (named ``batch``, ``sequence``, ``past_sequence``)
unless the spec's ``inputs`` pin them. Example sizes are all >= 2 and distinct: torch.export
specialises an axis whose example size is 1.
"""

from __future__ import annotations

import contextlib
import io
import warnings

from services.artifacts import Artifact
from services.converters.torch_to_onnx import DEFAULT_OPSET, MODEL_FILE, _describe, _failed
from services.errors import KilnError
from services.formats import Format
from services.steps.context import StepContext

__all__ = ["huggingface_to_onnx"]


def huggingface_to_onnx(ctx: StepContext) -> Artifact:
    """Convert the checkpoint's task graph to model.onnx with dynamic batch and sequence axes."""
    import torch

    from services.descriptors.huggingface import HuggingFaceOptions
    from services.runners.huggingface import HuggingFaceRunner

    options = ctx.spec.engine_options(HuggingFaceOptions)
    runner = HuggingFaceRunner(ctx.model.path, inputs=ctx.spec.inputs, options=options)
    opset = ctx.opset(DEFAULT_OPSET)
    dims: dict[str, torch.export.Dim] = {}
    dynamic: list[dict[int, torch.export.Dim]] = []
    for t in runner.inputs:
        axes = runner.dynamic_axes(t.name)
        dynamic.append({a: dims.setdefault(n, torch.export.Dim(n)) for a, n in axes.items()})
    dst = ctx.out_dir / MODEL_FILE
    ctx.progress(
        f"exporting {runner.checkpoint.model_type} ({runner.task}) to ONNX opset {opset} "
        f"(dynamic axes: {', '.join(dims) or 'none'})"
    )
    log = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(log), torch.no_grad():
            warnings.simplefilter("ignore")
            onnx_program = torch.onnx.export(
                runner.graph,
                runner.example_inputs(),
                dynamic_shapes={"args": tuple(dynamic)},
                input_names=[t.name for t in runner.inputs],
                output_names=[t.name for t in runner.outputs],
                opset_version=opset,
                dynamo=True,
                optimize=True,
            )
            assert onnx_program is not None
            onnx_program.save(str(dst))
    except KilnError:
        raise
    except Exception as exc:
        raise _failed(
            ctx,
            exc,
            "torch.onnx (dynamo exporter)",
            "torch.export could not trace this architecture or an operator has no ONNX translation: "
            "check the output tail; pinning the sequence length in the spec's `inputs` can help.",
        ) from exc
    return Artifact(
        root=ctx.out_dir,
        kind=Format.ONNX.value,
        entry=MODEL_FILE,
        meta={
            "exporter": "transformers + torch.onnx.export(dynamo=True)",
            "opset": opset,
            "task": runner.task,
            "model_type": runner.checkpoint.model_type,
            "dynamic_axes": {t.name: runner.dynamic_axes(t.name) for t in runner.inputs},
            "ignored_files": list(runner.checkpoint.ignored),
            "io": _describe(runner.inputs, runner.outputs),
        },
    )
