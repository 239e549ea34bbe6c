"""Run a set of onnxscript rewrite rules as one named Kiln pass."""

from __future__ import annotations

from typing import Any, ClassVar

import onnx_ir as ir

from services.passes._base import KilnPass, PassResult, op_types, opset_version

__all__ = ["RulesPass"]


class RulesPass(KilnPass):
    """Apply ``rules()`` (onnxscript RewriteRules) until none fires, at most ``max_rounds`` times."""

    #: Match commuted operands too (``Add(b, MatMul)`` as well as ``Add(MatMul, b)``).
    commute: bool = True
    max_rounds: int = 3
    #: The rules build opset-13 style nodes (Pad/Clip/Unsqueeze operands as inputs, not
    #: attributes); older graphs are left to the other passes.
    min_opset: int = 13
    #: Op types at least one rule starts from; a model with none of them is skipped without
    #: matching (empty: always match).
    triggers: frozenset[str] = frozenset()

    #: Compiled rule sets per pass class: compiling patterns costs more than matching them.
    _compiled: ClassVar[dict[type, Any]] = {}

    def rules(self) -> list[Any]:
        raise NotImplementedError

    def rule_set(self) -> Any:
        """Return this pass's compiled onnxscript RewriteRuleSet (built once per class)."""
        from onnxscript.rewriter import RewriteRuleSet

        cls = type(self)
        if cls not in RulesPass._compiled:
            RulesPass._compiled[cls] = RewriteRuleSet(self.rules(), commute=self.commute)
        return RulesPass._compiled[cls]

    def call(self, model: ir.Model) -> PassResult:
        if opset_version(model) < self.min_opset:
            return PassResult(model, False)
        if self.triggers and not self.triggers & op_types(model):
            return PassResult(model, False)
        rule_set = self.rule_set()
        modified = False
        # One sweep can expose another match (Relu(Relu(Relu x))); a few rounds reach the fixpoint.
        for _ in range(self.max_rounds):
            count = rule_set.apply_to_model(model)
            if not count:
                break
            modified = True
        return PassResult(model, modified)
