"""A Paddle ``.pdmodel`` program to OpenVINO IR with OpenVINO's own Paddle frontend (no Paddle needed).

The frontend reads the ProgramDesc and the ``.pdiparams`` of the same stem beside it; it
does not read Paddle 3's PIR ``.json`` programs (measured with OpenVINO 2026: "Cannot
recognize input model"), so those reach OpenVINO through paddle2onnx and ONNX. The model is
vetted and staged first, like every Paddle read: the frontend sees only the two files.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from services.artifacts import Artifact
from services.converters.openvino_ir import _convert, _finish
from services.formats.paddle import PADDLE, stage_paddle_model, vet_paddle_model
from services.steps.context import StepContext

__all__ = ["paddle_to_ir"]


def paddle_to_ir(ctx: StepContext) -> Artifact:
    """Convert the vetted .pdmodel program and its parameters to fp32 IR."""
    vetted = vet_paddle_model(ctx.model.path, PADDLE)
    staging = Path(tempfile.mkdtemp(prefix="kiln-paddle-", dir=ctx.scratch if ctx.scratch.is_dir() else None))
    try:
        staged = stage_paddle_model(vetted, staging)
        model = _convert(ctx, str(staged.program), f"Paddle program {vetted.program.name}")
        art = _finish(ctx, model, PADDLE, "Paddle ProgramDesc (.pdmodel + .pdiparams)")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    art.meta["paddle_ops"] = vetted.ops
    return art
