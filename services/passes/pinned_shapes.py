"""Pin a graph's inputs at static shapes and fold the shape arithmetic that becomes constant.

Converters that need static shapes (onnx2tf, TVM's Relax importer) fail on real models'
dynamic-shape arithmetic (``Shape -> Gather -> Concat -> Reshape``, ``ConstantOfShape`` chains)
even when the input shapes are given to them: the shapes must be in the graph and the
arithmetic folded first. Measured on real OCR, detector, file-type and text-encoder models:
tvm compiles 5 more of them this way (docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir
from onnx_ir.passes import PassResult

from services.passes._base import KilnPass

__all__ = ["FixInputShapes", "FoldConstantOfShape", "pin_input_shapes", "pinning_passes"]


class FoldConstantOfShape(KilnPass):
    """Fold ConstantOfShape nodes (and what they feed) once their shape is constant.

    onnxscript's folder keeps ConstantOfShape on purpose, a compact node for a possibly big
    tensor. At fixed input shapes it is what stops a traced BERT's token-type ids
    (``Expand(buffer, Where(Equal(shape, ConstantOfShape(...) * -1), ...))``) from folding,
    and onnx2tf fails on that all-constant arithmetic (it builds a Keras model whose output
    is a plain array); TVM's importer fails on it as a Reshape target it cannot infer. The size limits are the folder's defaults, as in Kiln's constant folding.
    """

    name = "onnx2tf_fold_constant_of_shape"  # the name manifests already record
    summary = "fold ConstantOfShape with a constant shape, and what it feeds (onnxscript keeps it on purpose)"

    def call(self, model: ir.Model) -> PassResult:
        from onnxscript.optimizer._constant_folding import (
            DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
            DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
        )

        from services.passes.folding import GuardedFolder

        folder = GuardedFolder(
            shape_inference=True,
            input_size_limit=DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
            output_size_limit=DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
            should_fold=lambda node: True if node.op_type == "ConstantOfShape" else None,
        )
        return PassResult(model, folder(model).modified)


class FixInputShapes(KilnPass):
    """Pin graph inputs at static shapes, so that shape inference and folding make their arithmetic constant."""

    name = "fix_input_shapes"
    summary = "pin graph inputs at static shapes (the converter cannot take this graph's dynamic-shape arithmetic)"

    def __init__(self, shapes: dict[str, list[int]]) -> None:
        super().__init__()
        self.shapes = shapes

    def call(self, model: ir.Model) -> PassResult:
        modified = False
        for value in model.graph.inputs:
            want = self.shapes.get(value.name or "")
            if want is None:
                continue
            shape = ir.Shape(want)
            if value.shape != shape:
                value.shape = shape
                modified = True
        return PassResult(model, modified)


def pinning_passes(shapes: dict[str, list[int]]) -> list[KilnPass]:
    """The passes that pin ``shapes`` and fold what becomes constant: Kiln's default passes after the two above."""
    from services.passes.pipeline import default_passes

    return [FixInputShapes(shapes), FoldConstantOfShape(), *default_passes()]


def pin_input_shapes(model: Any, shapes: dict[str, list[int]]) -> tuple[Any, list[dict[str, Any]]]:
    """Return ``model`` (an onnx ModelProto) with its inputs at ``shapes`` and its shape arithmetic folded, and the pass records."""
    from services.passes.pipeline import optimize_model

    pinned, report = optimize_model(model, pinning_passes(shapes), keep_inferred_shapes=True)
    return pinned, [r.to_dict() for r in report.passes]
