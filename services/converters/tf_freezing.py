"""Freeze a TensorFlow concrete function (variables → constants) into a GraphDef, without rebuilding it.

tf2onnx and the fp16/int8 tfserving export both need a frozen GraphDef of a serving
function. TensorFlow's ``convert_variables_to_constants_v2`` computes it in a quarter of a
second on Keras ResNet-50 and then spends ~3 s building a new ConcreteFunction from it
(``function_from_graph_def``: importing and pruning the 98 MiB graph), which both callers
only turn back into a GraphDef. This module stops after the first half, through the same
TensorFlow internals that function calls (it has no public split), and falls back to the
whole function if those internals move (a TensorFlow upgrade), so only the speed is at stake.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["FrozenGraph", "freeze_function"]


@dataclass
class FrozenGraph:
    """A frozen GraphDef and the tensor names of its inputs and outputs (the function's, in order)."""

    graph_def: Any
    inputs: list[str]
    outputs: list[str]


def _whole(concrete: Any, *, lower_control_flow: bool, aggressive_inlining: bool) -> FrozenGraph:
    from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2

    frozen = convert_variables_to_constants_v2(
        concrete, lower_control_flow=lower_control_flow, aggressive_inlining=aggressive_inlining
    )
    return FrozenGraph(
        frozen.graph.as_graph_def(),
        [t.name for t in frozen.inputs],
        [t.name for t in frozen.outputs],
    )


def freeze_function(
    concrete: Any, *, lower_control_flow: bool = True, aggressive_inlining: bool = False
) -> FrozenGraph:
    """Return ``concrete`` frozen: its variables are constants, its inputs only the real ones.

    The options mean what they mean to ``convert_variables_to_constants_v2``.
    """
    try:
        from tensorflow.python.framework import convert_to_constants as c2c

        data = c2c._FunctionConverterDataInEager(
            func=concrete, lower_control_flow=lower_control_flow, aggressive_inlining=aggressive_inlining
        )
        graph_def, converted = c2c._replace_variables_by_constants(converter_data=data)
        captures = concrete.graph.internal_captures
    except (AttributeError, ImportError, TypeError):  # the internals moved: the public function still works
        return _whole(concrete, lower_control_flow=lower_control_flow, aggressive_inlining=aggressive_inlining)
    # As _construct_concrete_function picks them: the inputs not turned into constants.
    frozen_ids = {id(captures[i]) for i in converted}
    inputs = [t.name for t in concrete.inputs if id(t) not in frozen_ids]
    return FrozenGraph(graph_def, inputs, [t.name for t in concrete.outputs])
