"""Passes that fuse node chains into one node: BatchNorm into Conv/Gemm, MatMul+Add into Gemm,
Pad into Conv, chained Relu/Clip/Min/Max into one Clip.

The rules are onnxscript's; where its checks miss a case that changes results, the
subclass here adds the check and says which case.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import RewriteRuleClassBase
from onnxscript.rewriter._basics import MatchResult
from onnxscript.rewriter.rules.common._fuse_batchnorm import (
    FuseBatchNormIntoConv,
    FuseBatchNormIntoConvTranspose,
    FuseBatchNormIntoGemm,
)
from onnxscript.rewriter.rules.common._matmul_add_to_gemm import MatMulAddToGemm

from services.passes._noop_rules import constant_array
from services.passes._rules import RulesPass

__all__ = [
    "FuseActivationClips",
    "FuseBatchNorm",
    "FuseConvAffine",
    "FuseMatMulAddToGemm",
    "FusePadIntoConv",
    "RemoveZeroBias",
]


class _BatchNormGuard:
    """Checks onnxscript's BatchNorm fusions leave out."""

    def check(self, context: Any, x: ir.Value, inbound_out: ir.Value, batchnorm_out: ir.Value) -> MatchResult:
        result = super().check(context, x, inbound_out, batchnorm_out)  # type: ignore[misc]
        if not result:
            return result
        bn = batchnorm_out.producer()
        inbound = inbound_out.producer()
        assert bn is not None and inbound is not None
        # Training mode normalises with the batch's own statistics and emits running stats.
        if bn.attributes.get_int("training_mode", 0) != 0:
            return result.fail("BatchNormalization in training mode")
        if any(out.uses() or out.is_graph_output() for out in bn.outputs[1:]):
            return result.fail("BatchNormalization's running statistics are used")
        params = [constant_array(v) for v in bn.inputs[1:5]]
        weight = constant_array(inbound.inputs[1])
        if weight is None or any(p is None for p in params):
            return result.fail("weights or statistics are not constants")
        # The fused weights are computed in the weights' dtype: mixed dtypes (BN-15 allows
        # float statistics on half data) would make the fused weight's dtype wrong.
        if any(p.dtype != weight.dtype for p in params):  # type: ignore[union-attr]
            return result.fail("BatchNormalization parameters and weights differ in dtype")
        if any(p.ndim != 1 for p in params):  # type: ignore[union-attr]
            return result.fail("statistics are not per-channel vectors (pre-opset-9 spatial=0)")
        if self.op_type == "Conv" and params[0].shape[0] != weight.shape[0]:  # type: ignore[attr-defined,union-attr]
            return result.fail("statistics do not match the Conv's output channels")
        return result


class GuardedBatchNormIntoConv(_BatchNormGuard, FuseBatchNormIntoConv):
    pass


class GuardedBatchNormIntoConvTranspose(_BatchNormGuard, FuseBatchNormIntoConvTranspose):
    pass


class GuardedBatchNormIntoGemm(_BatchNormGuard, FuseBatchNormIntoGemm):
    def check(self, context: Any, x: ir.Value, inbound_out: ir.Value, batchnorm_out: ir.Value) -> MatchResult:
        result = super().check(context, x, inbound_out, batchnorm_out)
        if not result:
            return result
        # BatchNorm normalises axis 1; on a 2-D Gemm output that is the N axis the fusion scales.
        if inbound_out.shape is None or inbound_out.shape.rank() != 2:
            return result.fail("Gemm output rank is not known to be 2")
        return result


class FuseBatchNorm(RulesPass):
    """Fold inference-mode BatchNormalization into the Conv, ConvTranspose or Gemm before it."""

    name = "fuse_batchnorm"
    summary = "fold BatchNormalization into the preceding Conv/ConvTranspose/Gemm weights (onnxscript rules, guarded)"
    triggers = frozenset({"BatchNormalization"})
    commute = False

    def rules(self) -> list[Any]:
        return [
            GuardedBatchNormIntoConv.rule(),
            GuardedBatchNormIntoConvTranspose.rule(),
            GuardedBatchNormIntoGemm.rule(),
        ]


#: Gemm kernels onnxruntime's CPU provider has; MatMul also takes integers, Gemm there does not.
_GEMM_DTYPES = frozenset({ir.DataType.FLOAT, ir.DataType.DOUBLE})


class GuardedMatMulAddToGemm(MatMulAddToGemm):
    """``Add(MatMul(a, b), c)`` → ``Gemm(a, b, c)`` only when c broadcasts into [M, N].

    Add broadcasts both ways, Gemm's C only one way: ``MatMul(a[1,K], b[K,N]) + c[M,N]``
    is [M,N] but ``Gemm`` would need C to fit [1,N]; and a rank-3 c makes Add's result rank 3.
    """

    # onnxscript hands a rule's matched values to check() as keywords named after the
    # pattern's variables, so the signature names them rather than matching the base's.
    def check(  # type: ignore[override]
        self, context: Any, input_a: ir.Value, input_b: ir.Value, input_c: ir.Value, **_: Any
    ) -> MatchResult:
        result = super().check(context, input_a, input_b)
        if not result:
            return result
        if input_a.dtype not in _GEMM_DTYPES or input_b.dtype != input_a.dtype or input_c.dtype != input_a.dtype:
            return result.fail(f"dtype {input_a.dtype} has no onnxruntime Gemm kernel")
        c = input_c.shape
        if c is None or c.rank() > 2:
            return result.fail("C's shape is unknown or has rank > 2")
        out = [input_a.shape[0], input_b.shape[1]]  # type: ignore[index]
        for c_dim, out_dim in zip(list(c), out[2 - c.rank() :], strict=True):
            if c_dim == 1:
                continue
            if not (isinstance(c_dim, int) and isinstance(out_dim, int) and c_dim == out_dim):
                return result.fail("C does not broadcast into the product's shape")
        return result


class FuseMatMulAddToGemm(RulesPass):
    """Turn a 2-D ``MatMul`` followed by a bias ``Add`` into one ``Gemm``."""

    name = "fuse_matmul_add"
    summary = "fuse 2-D MatMul + Add (also through Transposes) into Gemm (onnxscript rules, guarded)"
    triggers = frozenset({"MatMul"})

    def rules(self) -> list[Any]:
        return [GuardedMatMulAddToGemm.rule()]


def _per_channel(const: np.ndarray, out_rank: int, channels: int) -> np.ndarray | None:
    """Return ``const`` as a [channels] vector if it broadcasts along axis 1 of a rank-``out_rank``
    output without changing its shape; None otherwise."""
    if const.ndim > out_rank:
        return None
    shape = (1,) * (out_rank - const.ndim) + const.shape
    if any(d != 1 for i, d in enumerate(shape) if i != 1) or shape[1] not in (1, channels):
        return None
    return np.broadcast_to(const.reshape(-1), (channels,)).copy()


class _ConvAffine(RewriteRuleClassBase):
    """``Conv(x, W, B) * s`` or ``+ a`` with a per-channel constant, folded into W and B.

    Written here because onnxscript's conv/affine rules only take scalars, while TF graphs
    (tf2onnx) leave BatchNorm as a per-channel Mul after depthwise convolutions.
    """

    op_type = ""

    def pattern(self, op: Any, x: Any, conv_out: Any, c: Any) -> Any:
        return getattr(op, self.op_type)(op.Conv(x, _allow_other_inputs=True, _outputs=["conv_out"]), c)

    def check(self, context: Any, x: ir.Value, conv_out: ir.Value, c: ir.Value) -> MatchResult:
        result = MatchResult()
        conv = conv_out.producer()
        assert conv is not None
        weight_value = conv.inputs[1]
        weight = constant_array(weight_value)
        bias = constant_array(conv.inputs[2]) if len(conv.inputs) > 2 and conv.inputs[2] is not None else None
        const = constant_array(c)
        if (
            weight_value is None
            or weight is None
            or const is None
            or (len(conv.inputs) > 2 and conv.inputs[2] is not None and bias is None)
        ):
            return result.fail("weights, bias or operand are not constants")
        if const.dtype != weight.dtype or weight.dtype.kind != "f":
            return result.fail("operand and weights differ in dtype")
        vector = _per_channel(const, weight.ndim, weight.shape[0])
        if vector is None:
            return result.fail("operand is not a per-output-channel constant")
        # The weights are rewritten under their own name: nobody else may read them.
        for value in conv.inputs[1:]:
            if value is not None and any(user is not conv for user, _ in value.uses()):
                return result.fail(f"{value.name} is shared with another node")
        if (
            bias is None
            and self.op_type == "Add"
            and f"{weight_value.name}_bias" in getattr(context.graph_or_function, "initializers", {})
        ):
            return result.fail("the name for a new bias is taken")
        self._fused = self.fuse(weight, bias, vector)
        return result

    def fuse(
        self, weight: np.ndarray, bias: np.ndarray | None, vector: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray | None]:
        raise NotImplementedError

    def rewrite(self, op: Any, x: ir.Value, conv_out: ir.Value, c: ir.Value) -> Any:
        conv = conv_out.producer()
        assert conv is not None
        weight, bias = self._fused
        w_in = conv.inputs[1]
        assert w_in is not None  # check() refused a Conv without constant weights
        w_name = w_in.name
        inputs = [x, op.initializer(ir.tensor(weight), name=w_name)]
        if bias is not None:
            b_in = conv.inputs[2] if len(conv.inputs) > 2 else None
            b_name = b_in.name if b_in is not None else f"{w_name}_bias"
            inputs.append(op.initializer(ir.tensor(bias), name=b_name))
        return op.Conv(*inputs, **dict(conv.attributes))


class ConvMulFusion(_ConvAffine):
    op_type = "Mul"

    def fuse(
        self, weight: np.ndarray, bias: np.ndarray | None, vector: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray | None]:
        scaled = weight * vector.reshape((-1,) + (1,) * (weight.ndim - 1))
        return scaled.astype(weight.dtype), None if bias is None else (bias * vector).astype(bias.dtype)


class ConvAddFusion(_ConvAffine):
    op_type = "Add"

    def fuse(
        self, weight: np.ndarray, bias: np.ndarray | None, vector: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray | None]:
        base = np.zeros_like(vector) if bias is None else bias
        return weight, (base + vector).astype(weight.dtype)


class FuseConvAffine(RulesPass):
    """Fold a per-channel constant Mul or Add after a Conv into the Conv's weights and bias."""

    name = "fuse_conv_affine"
    summary = "fold per-channel constant Mul/Add after Conv into its weights and bias (Kiln rule)"
    triggers = frozenset({"Conv"})

    def rules(self) -> list[Any]:
        return [ConvMulFusion.rule(), ConvAddFusion.rule()]


class FusePadIntoConv(RulesPass):
    """Fold a zero constant Pad on spatial axes into the Conv's own pads."""

    name = "fuse_pad_conv"
    summary = "fold zero constant Pad on spatial axes into the following Conv's pads (onnxscript rule)"
    triggers = frozenset({"Pad"})
    commute = False

    def rules(self) -> list[Any]:
        from onnxscript.rewriter.rules.common import fuse_pad_into_conv_rule

        # Not ConvInteger: its implicit padding is the zero point, not the Pad's 0.
        return [fuse_pad_into_conv_rule]


class FuseActivationClips(RulesPass):
    """Merge chained Relu/Clip and Min/Max with constant bounds into one Relu or Clip."""

    name = "fuse_clips"
    summary = "merge Relu/Clip chains and Min(Max(x, lo), hi) into one Relu/Clip (onnxscript rules)"
    triggers = frozenset({"Relu", "Clip", "Min", "Max"})
    # Min/Max are variadic; onnxscript's commuting only handles binary ops.
    commute = False

    def rules(self) -> list[Any]:
        from onnxscript.rewriter.rules import common as r

        return [
            r.successive_relu_rule,
            r.successive_clip_rule,
            r.successive_clip_relu_rule,
            r.successive_relu_clip_rule,
            r.min_min_rule,
            r.max_max_rule,
            r.min_max_rule,
            r.max_min_rule,
        ]


class RemoveZeroBias(RulesPass):
    """Drop an all-zero bias input from Conv, ConvTranspose and Gemm."""

    name = "remove_zero_bias"
    summary = "drop all-zero optional bias inputs of Conv/ConvTranspose/Gemm (onnxscript rules)"
    triggers = frozenset({"Conv", "ConvTranspose", "Gemm"})
    commute = False

    def rules(self) -> list[Any]:
        from onnxscript.rewriter.rules import common as r

        return [
            r.remove_optional_bias_from_conv_rule,
            r.remove_optional_bias_from_conv_transpose_rule,
            r.remove_optional_bias_from_gemm_rule,
        ]
