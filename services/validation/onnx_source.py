"""Checks of an ONNX source's inputs against the spec, made at submission (API and `kiln compile`) from the graph alone.

The reference step applies the same rules to every format; for ONNX they are read from the
graph without its weights, so a job that could only fail in its first step is refused when
it is submitted: spec ``inputs`` the model does not have, and inputs no generated value is
valid for (shape operands, sequences: :mod:`services.runners.onnx_bounds`) without sample data.
"""

from __future__ import annotations

from pathlib import Path

from services.spec import CompileSpec
from services.tensors import TensorSpec
from services.validation.inputs import check_spec_inputs, refuse_ungeneratable

__all__ = ["check_onnx_inputs"]


def check_onnx_inputs(path: Path, spec: CompileSpec) -> None:
    """Raise INVALID_SPEC for spec inputs the ONNX model at ``path`` lacks, or inputs it needs real data for."""
    from services.errors import SourceUnreadable
    from services.onnx_io import load_onnx
    from services.runners.onnx_bounds import onnx_input_bounds

    try:
        graph = load_onnx(path, load_external_data=False).graph
    except SourceUnreadable:
        # Left to the reference step, the job's first: it names the cause (not a protobuf, a graph
        # the checker refuses, an op no runtime implements) with the hint for each.
        return
    initializers = {i.name for i in graph.initializer}
    inputs = [TensorSpec(v.name, "float32", ()) for v in graph.input if v.name not in initializers]
    check_spec_inputs(inputs, spec)
    if not spec.calibration:
        refuse_ungeneratable(inputs, spec, onnx_input_bounds(path))
