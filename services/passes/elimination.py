"""Passes that remove work: no-op nodes, identities, dead code, repeated sub-expressions.

They run after folding and fusion, which leave Identity nodes, unused constants and
duplicates behind.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as ir_common

from services.passes._base import KilnPass, PassResult, SequencePass, quiet_logger
from services.passes._rules import RulesPass

__all__ = [
    "CommonSubexpressions",
    "DeadCode",
    "DeduplicateInitializers",
    "EliminateNoOps",
    "IdentityElimination",
    "LiftConstants",
]


class EliminateNoOps(RulesPass):
    """Remove nodes that compute their input: x+0, x*1, identity Cast/Transpose/Expand, double reshapes."""

    name = "eliminate_no_ops"
    summary = (
        "drop no-op nodes (x+0, x*1, x/1, same-type Cast, identity Transpose/Expand) and merge "
        "Reshape/Transpose/Unsqueeze chains (onnxscript rules)"
    )

    triggers = frozenset(
        {"Add", "Sub", "Mul", "Div", "Cast", "Expand", "Transpose", "Reshape", "Squeeze", "Unsqueeze", "Slice"}
        | {"ConstantOfShape", "ScatterND"}
    )

    def rules(self) -> list[Any]:
        from onnxscript.rewriter.rules import common as r

        from services.passes import _noop_rules as g

        # Not taken from onnxscript's defaults, on purpose:
        # - slice_split_rule: checks begin1 == last_dim // 2 but emits Split(num_outputs=2),
        #   which cuts an odd axis ceil-first, and needs opset 18 (merge_slices covers it);
        # - flatten_to_reshape_rule: trades one node for another;
        # - cast_cast_rule: replaced by a guarded version (double rounding).
        return [
            *g.guarded_no_op_rules(),
            r.no_op_cast_rule,
            r.no_op_expand_rule,
            r.no_op_transpose_rule,
            r.transpose_transpose_rule,
            r.reshape_reshape_rule,
            r.unsqueeze_unsqueeze_rule,
            r.squeeze_reshape_1d_rule,
            r.collapse_slice_rule,
            r.collapse_slice2_rule,
            r.cast_constant_of_shape_rule,
            r.cast_constant_of_shape_without_value_rule,
            r.no_op_static_scatter_nd_rule,
            r.no_op_dynamic_scatter_nd_rule,
            g.GuardedCastCast.rule(),
        ]


class _GuardedIdentityElimination(ir_common.IdentityEliminationPass):
    """onnx_ir's pass, minus the cases where it renames a value it must not.

    For ``y = Identity(x)`` with y a graph output, onnx_ir renames x to y. That breaks the
    graph when x is itself an output of the graph (two outputs become one value with one
    name: a Scan body's ``state_out`` and ``scan_out``), and when x belongs to an enclosing
    graph (a subgraph would rename its parent's value). It also fails on ranks that disagree.
    """

    def _try_eliminate_identity_node(self, node: ir.Node) -> bool:
        if node.op_type == "Identity" and node.domain == "" and len(node.inputs) == 1 and len(node.outputs) == 1:
            x, y = node.inputs[0], node.outputs[0]
            if x is not None and y.is_graph_output() and (x.is_graph_output() or x.graph is not node.graph):
                return False
            if x is not None and x.shape is not None and y.shape is not None and x.shape.rank() != y.shape.rank():
                return False
        return super()._try_eliminate_identity_node(node)


class IdentityElimination(SequencePass):
    """Remove Identity nodes, keeping graph input and output names."""

    name = "identity_elimination"
    summary = "remove Identity nodes, keeping graph input/output names (onnx_ir IdentityEliminationPass, guarded)"

    def passes(self) -> list[ir.passes.PassBase]:
        return [_GuardedIdentityElimination()]


#: Random ops onnx_ir's CSE does not know about: two of them with the same inputs are two draws.
_RANDOM_OPS = frozenset({"Bernoulli", "Dropout"})


class CommonSubexpressions(KilnPass):
    """Merge nodes that compute the same thing from the same inputs (onnx_ir CSE)."""

    name = "common_subexpressions"
    summary = "merge identical nodes on identical inputs (onnx_ir CommonSubexpressionEliminationPass)"

    def call(self, model: ir.Model) -> PassResult:
        # onnx_ir skips RandomNormal & co. but not Bernoulli or training-mode Dropout; merging
        # two such draws would make them equal. Such graphs are rare enough to skip whole.
        if any(n.op_type in _RANDOM_OPS for n in ir.traversal.RecursiveGraphIterator(model.graph)):
            return PassResult(model, False)
        return PassResult(model, ir_common.CommonSubexpressionEliminationPass()(model).modified)


class DeadCode(SequencePass):
    """Remove nodes whose outputs nobody reads, then unused functions and opset imports."""

    name = "dead_code"
    summary = "remove nodes, functions and opset imports nothing uses (onnx_ir unused-removal passes)"

    def passes(self) -> list[ir.passes.PassBase]:
        return [
            ir_common.RemoveUnusedNodesPass(),
            ir_common.RemoveUnusedFunctionsPass(),
            ir_common.RemoveUnusedOpsetsPass(),
        ]


class LiftConstants(SequencePass):
    """Turn Constant nodes into initializers, so weights sit in one place and nodes count real work."""

    name = "lift_constants"
    summary = "turn Constant nodes into initializers (onnx_ir LiftConstantsToInitializersPass)"

    def passes(self) -> list[ir.passes.PassBase]:
        return [ir_common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)]

    def call(self, model: ir.Model) -> PassResult:
        # Before IR version 4 every initializer must also be a graph input; lifting would
        # either break that rule or add inputs to the model's signature.
        if model.ir_version < 4:
            return PassResult(model, False)
        return super().call(model)


class DeduplicateInitializers(SequencePass):
    """Share one copy of initializers with identical contents."""

    name = "deduplicate_initializers"
    summary = "share initializers with identical dtype, shape and bytes (onnx_ir DeduplicateHashedInitializersPass)"

    def passes(self) -> list[ir.passes.PassBase]:
        return [ir_common.DeduplicateHashedInitializersPass()]

    def call(self, model: ir.Model) -> PassResult:
        # onnx_ir warns once per initializer that is also a graph input (it rightly skips
        # those); for pre-IR-4 models that is every weight. Nothing for an operator to act on.
        _make_contiguous(model)
        with quiet_logger("onnx_ir.passes.common.initializer_deduplication"):
            return super().call(model)


def _make_contiguous(model: ir.Model) -> None:
    # Folding a Transpose leaves a numpy view as the constant; onnx_ir hashes raw buffers
    # and refuses non-contiguous ones. Same values, laid out plainly.
    for graph in model.graphs():
        for value in graph.initializers.values():
            tensor = value.const_value
            if (
                isinstance(tensor, ir.Tensor)
                and isinstance(tensor.raw, np.ndarray)
                and not tensor.raw.flags.c_contiguous
            ):
                value.const_value = ir.Tensor(np.ascontiguousarray(tensor.raw), dtype=tensor.dtype, name=tensor.name)
