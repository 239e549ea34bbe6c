"""PyTorch sources to ONNX: TorchScript through torch's TorchScript exporter, torch.export
programs through its dynamo exporter (onnxscript).

Both read the source through the vetted loaders of :mod:`services.runners.torch_archives`
and name the ONNX inputs and outputs exactly as the torch runners do, so parity pairs
outputs by name. Opset: the step's ``opset`` option (the spec's), else
:data:`DEFAULT_OPSET` = 18, the dynamo exporter's native opset (lower ones go through
ONNX's version converter) and one every CPU engine Kiln targets reads.

TorchScript files carry no shapes: the example inputs come from the spec's ``inputs`` or
the shapes a traced module recorded (see :class:`services.runners.torch.TorchScriptRunner`);
the axes left dynamic are the batch axis plus those the spec marks -1 or gives different
``min``/``max``. An ExportedProgram keeps the dynamic axes it was exported with.
"""

from __future__ import annotations

import contextlib
import io
import traceback
import warnings
from typing import Any

import numpy as np

from services.artifacts import Artifact
from services.errors import ConversionFailed, KilnError
from services.formats import Format
from services.steps.context import StepContext
from services.tensors import TensorSpec
from services.validation import resolve_shape
from services.validation.inputs import random_input

__all__ = ["DEFAULT_OPSET", "exported_program_to_onnx", "torchscript_to_onnx"]

DEFAULT_OPSET = 18
MODEL_FILE = "model.onnx"


def _failed(ctx: StepContext, exc: Exception, tool: str, hint: str) -> ConversionFailed:
    tail = "".join(traceback.format_exception(exc))[-2000:]
    return ConversionFailed(
        f"{tool} could not convert {ctx.source.path.name}: {type(exc).__name__}: {str(exc)[:500]}",
        hint=hint,
        step=ctx.step.id,
        tool=tool,
        output_tail=tail,
    )


def _describe(inputs: list[TensorSpec], outputs: list[TensorSpec]) -> dict[str, Any]:
    return {"inputs": [t.to_dict() for t in inputs], "outputs": [t.to_dict() for t in outputs]}


def _wrapped(runner: Any, example: tuple[Any, ...]) -> Any:
    """Return the runner's module traced behind a wrapper that takes the fed tensors alone.

    The wrapper puts the spec's pinned values (``inputs.<name>.value``) in their places, so
    the exported graph is specialised for them and its signature leaves them out; and it
    returns the output leaves as a tuple, since the TorchScript exporter cannot emit dict
    outputs (prim::DictConstruct, as traced Hugging Face models return). Tracing a wrapper
    keeps the inner module's TorchScript graph as a call (its control flow intact).
    """
    import torch
    from torch.utils import _pytree as pytree

    names = [t.name for t in runner.inputs]

    class Pinned(torch.nn.Module):
        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, *tensors: Any) -> tuple[Any, ...]:
            args = runner.call_arguments(dict(zip(names, tensors, strict=True)))
            return tuple(pytree.tree_leaves(self.inner(*args)))

    with torch.no_grad():
        return torch.jit.trace(Pinned(runner.module), example, strict=False, check_trace=False)


def torchscript_to_onnx(ctx: StepContext) -> Artifact:
    """Convert the TorchScript model to model.onnx with the spec's input shapes and dynamic axes."""
    import torch

    from services.runners.torch import TorchScriptRunner

    runner = TorchScriptRunner(ctx.model.path, inputs=ctx.spec.inputs)
    opset = ctx.opset(DEFAULT_OPSET)
    rng = np.random.default_rng(ctx.spec.validation.seed)
    example = tuple(torch.from_numpy(random_input(t, resolve_shape(t, ctx.spec), rng)) for t in runner.inputs)
    dynamic_axes = {
        t.name: {a: ("batch" if a == 0 else f"{t.name}_dim{a}") for a, d in enumerate(t.shape) if d is None}
        for t in runner.inputs
    }
    dynamic_axes = {k: v for k, v in dynamic_axes.items() if v}
    dst = ctx.out_dir / MODEL_FILE
    ctx.progress(f"exporting TorchScript to ONNX opset {opset} (dynamic axes {dynamic_axes or 'none'})")
    try:
        if runner.static_arguments or runner.structured_output:
            module = _wrapped(runner, example)
        else:
            module = runner.module
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
            torch.onnx.export(
                module,
                example,
                str(dst),
                input_names=[t.name for t in runner.inputs],
                output_names=[t.name for t in runner.outputs],
                dynamic_axes=dynamic_axes or None,
                opset_version=opset,
                do_constant_folding=True,
                dynamo=False,
            )
    except KilnError:
        raise
    except Exception as exc:
        raise _failed(
            ctx,
            exc,
            "torch.onnx (TorchScript exporter)",
            "An operator may lack an ONNX mapping at this opset: try a higher `opset`, or export the "
            "model with torch.export (.pt2), whose exporter covers more of PyTorch.",
        ) from exc
    return Artifact(
        root=ctx.out_dir,
        kind=Format.ONNX.value,
        entry=MODEL_FILE,
        meta={
            "exporter": "torch.onnx.export(dynamo=False)",
            "opset": opset,
            "dynamic_axes": dynamic_axes,
            "flattened_outputs": runner.structured_output,
            "static_arguments": runner.static_arguments,
            "io": _describe(runner.inputs, runner.outputs),
        },
    )


def exported_program_to_onnx(ctx: StepContext) -> Artifact:
    """Convert the ExportedProgram to model.onnx with torch's dynamo exporter."""
    import torch

    from services.runners.torch import ExportedProgramRunner

    runner = ExportedProgramRunner(ctx.model.path, inputs=ctx.spec.inputs)
    opset = ctx.opset(DEFAULT_OPSET)
    dst = ctx.out_dir / MODEL_FILE
    ctx.progress(f"exporting the ExportedProgram to ONNX opset {opset}")
    log = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(log):
            warnings.simplefilter("ignore")
            onnx_program = torch.onnx.export(
                runner.program,
                (),
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
            "An operator may have no ONNX translation: check the output tail for its name.",
        ) from exc
    return Artifact(
        root=ctx.out_dir,
        kind=Format.ONNX.value,
        entry=MODEL_FILE,
        meta={
            "exporter": "torch.onnx.export(dynamo=True)",
            "opset": opset,
            "io": _describe(runner.inputs, runner.outputs),
        },
    )
