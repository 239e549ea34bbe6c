"""onnxscript's no-op rules with the guards they lack.

onnxscript rewrites ``x + 0`` to ``x`` whatever the shapes, but ``Add(x[2,1], zeros[3])``
has shape [2,3]: dropping it changes the output. It also merges ``Cast(Cast(x))`` chains
whose first cast rounds (float64 → float32 → float16 rounds twice). These versions check.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import RewriteRuleClassBase
from onnxscript.rewriter._basics import MatchResult
from onnxscript.rewriter.rules.common._basic_rules import CastCast

__all__ = ["GuardedCastCast", "constant_array", "guarded_no_op_rules"]


def constant_array(value: ir.Value | None) -> np.ndarray | None:
    """Return ``value``'s contents when it is a true constant (not an overridable graph input)."""
    if value is None or value.is_graph_input():
        return None
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant" and producer.domain in ("", "ai.onnx"):
        from onnxscript.optimizer import basic_constant_propagation

        basic_constant_propagation([producer])
    if value.const_value is None:
        return None
    try:
        return value.const_value.numpy()
    except Exception:
        return None


def _broadcast_keeps_shape(x: ir.Value, const: np.ndarray) -> bool:
    """True when broadcasting ``const`` against ``x`` leaves x's shape and dtype as they are."""
    if x.shape is None or x.dtype is None or const.ndim > x.shape.rank():
        return False
    if ir.DataType.from_numpy(const.dtype) != x.dtype:
        return False
    x_dims = list(x.shape)[x.shape.rank() - const.ndim :]
    return all(c == 1 or (isinstance(d, int) and d == c) for c, d in zip(const.shape, x_dims, strict=True))


class _BinaryNoOp(RewriteRuleClassBase):
    """``op(x, c)`` is ``x`` when every element of constant c is the op's neutral element."""

    op_type: ClassVar[str] = ""
    neutral: ClassVar[float] = 0.0

    def pattern(self, op: Any, x: Any, c: Any) -> Any:
        return getattr(op, self.op_type)(x, c)

    def check(self, context: Any, x: ir.Value, c: ir.Value) -> MatchResult:
        result = MatchResult()
        const = constant_array(c)
        if const is None or const.size == 0:
            return result.fail("second operand is not a constant")
        if not np.all(const == self.neutral):
            return result.fail(f"constant is not all {self.neutral}")
        if not _broadcast_keeps_shape(x, const):
            return result.fail("broadcasting would change the shape or dtype")
        if context.output_values[0].is_graph_output() and x.is_graph_input():
            return result.fail("graph input straight to graph output: keep the node")
        return result

    def rewrite(self, op: Any, x: ir.Value, c: ir.Value) -> Any:
        return op.Identity(x)


class AddZero(_BinaryNoOp):
    op_type = "Add"
    neutral = 0.0


class SubZero(_BinaryNoOp):
    op_type = "Sub"
    neutral = 0.0


class MulOne(_BinaryNoOp):
    op_type = "Mul"
    neutral = 1.0


class DivOne(_BinaryNoOp):
    op_type = "Div"
    neutral = 1.0


class FlattenVector(RewriteRuleClassBase):
    """``Reshape(v, [-1])`` of a 1-D ``v`` is ``v``.

    Written here because onnxscript has no rule for it, and TorchScript exports write one
    after every shape vector they assemble with Concat (``expand``'s target shape).
    """

    def pattern(self, op: Any, x: Any, shape: Any) -> Any:
        return op.Reshape(x, shape, _allow_other_attributes=True)

    def check(self, context: Any, x: ir.Value, shape: ir.Value) -> MatchResult:
        result = MatchResult()
        target = constant_array(shape)
        if target is None or target.reshape(-1).tolist() != [-1]:
            return result.fail("target shape is not [-1]")
        if x.shape is None or x.shape.rank() != 1:
            return result.fail("input is not known to be 1-D")
        return result

    def rewrite(self, op: Any, x: ir.Value, shape: ir.Value) -> Any:
        return op.Identity(x)


def guarded_no_op_rules() -> list[Any]:
    """Return the x+0, x-0, x*1, x/1 rules (a commuting rule set also matches 0+x and 1*x) and 1-D flattening."""
    return [AddZero.rule(), SubZero.rule(), MulOne.rule(), DivOne.rule(), FlattenVector.rule()]


#: Types every float32 holds exactly, so casting through float32 rounds nothing.
_EXACT_IN_FLOAT32 = frozenset(
    {
        ir.DataType.FLOAT,
        ir.DataType.FLOAT16,
        ir.DataType.BFLOAT16,
        ir.DataType.INT8,
        ir.DataType.UINT8,
        ir.DataType.INT16,
        ir.DataType.UINT16,
        ir.DataType.BOOL,
    }
)


class GuardedCastCast(CastCast):
    """``Cast(Cast(x, float32), float16)`` → ``Cast(x, float16)`` only when the first cast is exact."""

    def check(self, context: Any, x: ir.Value, to: ir.Attr, to_ignored: ir.Attr) -> MatchResult:
        result = super().check(context, x, to, to_ignored)
        if not result:
            return result
        if x.dtype not in _EXACT_IN_FLOAT32:
            return result.fail(f"casting {x.dtype} to float32 may round; the two casts round twice")
        return result
