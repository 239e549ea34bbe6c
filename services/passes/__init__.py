"""Kiln's ONNX optimiser: composable passes run by a pass manager, and the optimize step.

``optimize_model(model)`` runs the default pipeline (shape inference, constant folding,
no-op and identity elimination, BatchNorm/Pad/MatMul+Add fusions, CSE, dead code) and
returns the optimised copy with a report of what each pass changed and how long it took.
Most passes wrap onnx_ir's passes or onnxscript's rewrite rules, with guards where those
would change results.
"""

from __future__ import annotations

from services.passes._base import KilnPass, PassResult, count_nodes
from services.passes.manager import OptimizeReport, PassManager, PassRecord
from services.passes.pipeline import default_passes, optimize_model
from services.passes.verify import OutputCheck

__all__ = [
    "KilnPass",
    "OptimizeReport",
    "OutputCheck",
    "PassManager",
    "PassRecord",
    "PassResult",
    "count_nodes",
    "default_passes",
    "optimize_model",
]
