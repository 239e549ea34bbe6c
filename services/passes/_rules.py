"""Run a set of onnxscript rewrite rules as one named Kiln pass."""

from __future__ import annotations

from typing import Any

import onnx_ir as ir

from services.passes._base import KilnPass, PassResult, opset_version

__all__ = ["RulesPass"]


class RulesPass(KilnPass):
    """Apply ``rules()`` (onnxscript RewriteRules) until none fires, at most ``max_rounds`` times."""

    #: Match commuted operands too (``Add(b, MatMul)`` as well as ``Add(MatMul, b)``).
    commute: bool = True
    max_rounds: int = 3
    #: The rules build opset-13 style nodes (Pad/Clip/Unsqueeze operands as inputs, not
    #: attributes); older graphs are left to the other passes.
    min_opset: int = 13

    def rules(self) -> list[Any]:
        raise NotImplementedError

    def call(self, model: ir.Model) -> PassResult:
        from onnxscript.rewriter import RewriteRuleSet

        if opset_version(model) < self.min_opset:
            return PassResult(model, False)
        rule_set = RewriteRuleSet(self.rules(), commute=self.commute)
        modified = False
        # One sweep can expose another match (Relu(Relu(Relu x))); a few rounds reach the fixpoint.
        for _ in range(self.max_rounds):
            count = rule_set.apply_to_model(model)
            if not count:
                break
            modified = True
        return PassResult(model, modified)
