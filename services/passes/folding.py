"""Passes that make values known: function inlining, shape inference, constant folding.

Folding comes first in the default pipeline because every fusion after it matches on
constant weights and known shapes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as ir_common
from onnxscript.optimizer import FOLDED_FROM_KEY, _constant_folding
from onnxscript.optimizer._constant_folding import (
    DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
    DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
    FoldConstantsPass,
    ReferenceEvaluator,
)

from services.passes._base import KilnPass, PassResult, SequencePass, opset_version, quiet_logger
from services.passes._noop_rules import constant_array
from services.passes._rules import RulesPass

__all__ = ["ConstantFolding", "FoldShapeDims", "InlineFunctions", "MaterializeReshapeShapes", "ShapeInference"]


class InlineFunctions(SequencePass):
    """Inline model-local functions so folding and fusions see through them."""

    name = "inline_functions"
    summary = "inline model-local functions (onnx_ir InlinePass), then drop the unused ones"

    def passes(self) -> list[ir.passes.PassBase]:
        return [ir_common.InlinePass(), ir_common.RemoveUnusedFunctionsPass()]


class ShapeInference(KilnPass):
    """Annotate tensor value types and shapes with onnx's shape inference (data propagation on).

    onnx_ir's ShapeInferencePass would do, but its merge writes a tensor dtype onto values
    that hold sequences or optionals (a Loop carrying ``seq(float)`` comes out declared as
    ``float``, which onnxruntime then rejects). This merge only refines tensor types and
    never overrides a dimension that is already a different number.
    """

    name = "shape_inference"
    summary = "infer tensor types and shapes (onnx.shape_inference with data propagation), merged conservatively"

    def call(self, model: ir.Model) -> PassResult:
        import onnx
        from onnx_ir.passes.common import _c_api_utils

        def infer(proto: onnx.ModelProto) -> onnx.ModelProto:
            # Non-strict: one node onnx cannot infer should not cost the shapes of all others.
            return onnx.shape_inference.infer_shapes(proto, check_type=False, strict_mode=False, data_prop=True)

        try:
            # call_onnx_api leaves large weights out of the proto it hands to onnx (2 GB limit).
            inferred = ir.serde.deserialize_model(_c_api_utils.call_onnx_api(infer, model))
        except Exception:
            return PassResult(model, False)
        modified = False
        for graph, inferred_graph in zip(model.graphs(), inferred.graphs(), strict=False):
            known = ir.convenience.create_value_mapping(inferred_graph)
            for name, value in ir.convenience.create_value_mapping(graph).items():
                other = known.get(name)
                if other is not None and _refine(value, other):
                    modified = True
        return PassResult(model, modified)


def _refine(value: ir.Value, inferred: ir.Value) -> bool:
    """Copy what inference learned about a tensor value onto ``value``; True if anything changed."""
    if not isinstance(inferred.type, ir.TensorType):
        return False
    if value.type is not None and (not isinstance(value.type, ir.TensorType) or value.dtype != inferred.dtype):
        return False
    changed = False
    if value.type is None:
        value.type = inferred.type
        changed = True
    if inferred.shape is None:
        return changed
    if value.shape is None:
        value.shape = inferred.shape
        return True
    if value.shape.rank() != inferred.shape.rank():
        return changed
    dims: list[int | ir.SymbolicDim] = []
    for mine, theirs in zip(value.shape, inferred.shape, strict=True):
        if isinstance(mine, int):
            if isinstance(theirs, int) and theirs != mine:
                return changed  # inference disagrees with a declared size: trust neither, change nothing
            dims.append(mine)
        elif isinstance(theirs, int) or (mine.value is None and theirs.value is not None):
            dims.append(theirs)
        else:
            dims.append(mine)
    new_shape = ir.Shape(dims)
    if new_shape != value.shape:
        value.shape = new_shape
        changed = True
    return changed


class ConstantFolding(KilnPass):
    """Evaluate every node whose inputs are all constant (onnxscript's folder, plus static dims)."""

    name = "constant_folding"
    summary = (
        "fold constant sub-expressions and static shape arithmetic (onnxscript FoldConstantsPass, "
        "plus Gather(Shape(x), k) on static dims)"
    )
    #: Folding a dimension can make the arithmetic on it constant, which folds again.
    max_rounds = 4

    def call(self, model: ir.Model) -> PassResult:
        modified = False
        for _ in range(self.max_rounds):
            folder = GuardedFolder(
                shape_inference=True,
                should_fold=_fold_small_constant_of_shape,
                input_size_limit=DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
                output_size_limit=DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
            )
            # The folder logs a warning per node it cannot evaluate (sequences, odd types):
            # expected, and nothing an operator can act on.
            with quiet_logger("onnxscript.optimizer._constant_folding"):
                modified = folder(model).modified or modified
            if not FoldShapeDims()(model).modified:
                break
            modified = True
        _drop_folding_notes(model)
        return PassResult(model, modified)


#: ConstantOfShape outputs up to this many elements are folded; onnxscript keeps every
#: ConstantOfShape (its output can be far larger than its input), but the small ones build
#: shape vectors (TorchScript's ``expand``: ``Where(Equal(shape, -1 * ones), ones, shape)``)
#: and folding them lets that whole chain fold.
SMALL_CONSTANT_OF_SHAPE = 64


def _fold_small_constant_of_shape(node: ir.Node) -> bool | None:
    """Return True for a ConstantOfShape with a small constant shape; None leaves it to onnxscript."""
    if node.op_type != "ConstantOfShape" or node.domain not in ("", "ai.onnx") or not node.inputs:
        return None
    shape = constant_array(node.inputs[0])
    if shape is None or shape.ndim != 1 or (shape < 0).any() or int(np.prod(shape)) > SMALL_CONSTANT_OF_SHAPE:
        return None
    return True


#: onnxscript folds these sequence ops into Split/Squeeze/Unsqueeze with their opset-13
#: operands-as-inputs form, which older graphs cannot hold.
_OPSET13_REWRITES = frozenset({"SplitToSequence", "ConcatFromSequence"})


class _Evaluator(ReferenceEvaluator):
    """onnxscript's evaluator (onnx.reference underneath) with numpy for the ops onnx.reference gets wrong.

    onnx.reference 1.23's GatherElements fails whenever the indices select fewer positions
    than the data holds along the axis (``cannot reshape array of size 1 into shape (1,64)``):
    the token-type ids of a TorchScript BERT (a ``[1, 512]`` buffer sliced to the sequence)
    then never fold at pinned shapes. ``numpy.take_along_axis`` is GatherElements.
    """

    def get_evaluator(self, domain: str, op: str, version: int) -> Any:
        if domain in ("", "ai.onnx") and op == "GatherElements":
            return _gather_elements
        return super().get_evaluator(domain, op, version)


def _gather_elements(data: np.ndarray, indices: np.ndarray, axis: int = 0) -> np.ndarray:
    axis = axis % data.ndim
    indices = np.where(indices < 0, indices + data.shape[axis], indices)  # ONNX allows negative indices
    # Off the axis GatherElements reads the leading positions (indices may be shorter there); numpy broadcasts.
    window = tuple(slice(None) if d == axis else slice(0, n) for d, n in enumerate(indices.shape))
    return np.take_along_axis(data[window], indices.astype(np.int64), axis=axis)


# The folder evaluates through this module-level instance; Kiln's replaces it once, for every fold.
_constant_folding._reference_evaluator = _Evaluator()


class GuardedFolder(FoldConstantsPass):
    """onnxscript's folder, leaving alone the nodes its special-case handlers get wrong."""

    def process_node(self, node: ir.Node, is_function: bool) -> Any:
        if node.op_type in _OPSET13_REWRITES and self._opset_imports.get(node.domain, 0) < 13:
            return None
        try:
            return super().process_node(node, is_function)
        except RuntimeError:
            # A handler crashed on this node (SplitToSequence with a non-constant split
            # does, in onnxscript 0.7): not folding one node is always safe.
            return None


def _drop_folding_notes(model: ir.Model) -> None:
    # onnxscript notes on every folded value which inputs it came from; that is debugging
    # metadata, not something to ship in every artifact's value_info.
    for graph in model.graphs():
        values = [*graph.inputs, *graph.initializers.values()]
        values += [out for node in graph for out in node.outputs]
        for value in values:
            value.metadata_props.pop(FOLDED_FROM_KEY, None)


class FoldShapeDims(KilnPass):
    """Replace ``Gather(Shape(x), k)`` with a constant when axis ``k`` of ``x`` is static.

    Written here because onnxscript's folder only folds 1-D indices into a shape, while
    torch's exporter reads dimensions one at a time with scalar indices (``x.size(2)``);
    without this the head-size arithmetic of every attention block stays in the graph.
    """

    name = "fold_shape_dims"
    summary = "fold Gather(Shape(x), k) to a constant when dimension k of x is static"

    def call(self, model: ir.Model) -> PassResult:
        modified = False
        for graph in model.graphs():
            for node in list(graph):
                replacement = _static_dim(node)
                if replacement is None:
                    continue
                out = node.outputs[0]
                if out.is_graph_output():
                    continue  # keep the output's producer and name; rare and not worth a rename
                const = ir.node(
                    "Constant",
                    inputs=[],
                    attributes={"value": ir.tensor(replacement, name=f"{out.name}_folded")},
                    outputs=[ir.Value(name=f"{out.name}_folded")],
                )
                const.outputs[0].type = ir.TensorType(ir.DataType.INT64)
                const.outputs[0].shape = ir.Shape(replacement.shape)
                const.outputs[0].const_value = const.attributes["value"].as_tensor()
                graph.insert_before(node, const)
                ir.convenience.replace_all_uses_with(out, const.outputs[0])
                graph.remove(node, safe=True)
                modified = True
        return PassResult(model, modified)


def _static_dim(node: ir.Node) -> np.ndarray | None:
    """Return the constant a Gather over a Shape evaluates to, or None when it is not static."""
    if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return None
    if node.attributes.get_int("axis", 0) != 0:
        return None
    shape_value, indices = node.inputs
    producer = shape_value.producer() if shape_value is not None else None
    if producer is None or producer.op_type != "Shape" or producer.domain not in ("", "ai.onnx"):
        return None
    idx = constant_array(indices)
    if idx is None or producer.inputs[0] is None:
        return None
    data_shape = producer.inputs[0].shape
    if data_shape is None:
        return None
    rank = len(data_shape)
    start = producer.attributes.get_int("start", 0)
    end = producer.attributes.get_int("end", rank)
    # Shape's start/end clamp like Python slicing; reuse it.
    dims = list(data_shape)[slice(start, end)]
    if idx.dtype.kind not in "iu":
        return None
    flat = idx.reshape(-1).tolist()
    if any(i < -len(dims) or i >= len(dims) for i in flat):
        return None  # out of range: ORT raises at run time; leave that behaviour alone
    picked = [dims[i] for i in flat]
    if not all(isinstance(d, int) for d in picked):
        return None
    return np.array(picked, dtype=np.int64).reshape(idx.shape)


def _computed(value: ir.Value | None) -> bool:
    """Return whether ``value`` is computed at run time (neither a constant nor a Constant's output)."""
    if value is None or value.const_value is not None:
        return False
    producer = value.producer()
    return producer is None or producer.op_type != "Constant"


def _has_computed_reshape(model: ir.Model) -> bool:
    return any(
        node.op_type == "Reshape" and len(node.inputs) > 1 and _computed(node.inputs[1])
        for graph in model.graphs()
        for node in graph
    )


class MaterializeReshapeShapes(RulesPass):
    """Replace a Reshape's computed target shape with a constant when its output shape is known."""

    name = "materialize_reshape_shapes"
    summary = (
        "re-infer shapes after folding, then replace computed Reshape shapes with constants where "
        "the output shape is known (onnxscript rule)"
    )
    commute = False
    # The rewritten Reshape carries allowzero=1, an attribute since opset 14.
    min_opset = 14

    def rules(self) -> list[Any]:
        from onnxscript.rewriter.rules.common import materialize_reshape_shape_rule

        return [materialize_reshape_shape_rule]

    def call(self, model: ir.Model) -> PassResult:
        if opset_version(model) < self.min_opset or not _has_computed_reshape(model):
            return PassResult(model, False)
        # Folding has just made shape arithmetic constant; the Reshape outputs only become
        # known when inference runs again over the folded graph.
        ShapeInference()(model)
        return super().call(model)
