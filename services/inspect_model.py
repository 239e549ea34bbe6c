"""`kiln inspect`: what a model is, its inputs and outputs, opset and operator histogram."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.formats import Format, open_source
from services.tensors import TensorSpec

__all__ = ["ModelSummary", "inspect_model"]


@dataclass
class ModelSummary:
    """A model at a glance."""

    format: str
    seen: str
    sha256: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    opset: dict[str, int] = field(default_factory=dict)
    ops: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: Tensor name -> {"scale", "zero_point"}, for inputs and outputs the file stores as quantised integers.
    quantization: dict[str, dict[str, float | int]] = field(default_factory=dict)

    def tensor_dict(self, t: TensorSpec) -> dict[str, Any]:
        """Return a tensor as the file declares it: its dtype, and the scale and zero point of a quantised one."""
        d = t.to_dict()
        if t.name in self.quantization:
            d["quantization"] = self.quantization[t.name]
        return d

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "seen": self.seen,
            "sha256": self.sha256,
            "inputs": [self.tensor_dict(t) for t in self.inputs],
            "outputs": [self.tensor_dict(t) for t in self.outputs],
            "opset": self.opset,
            "ops": self.ops,
            "notes": self.notes,
        }


def _onnx_summary(path: Path) -> tuple[list[TensorSpec], list[TensorSpec], dict[str, int], dict[str, int]]:
    import onnx

    from services.onnx_io import load_onnx

    model = load_onnx(path, load_external_data=False)

    def spec(vi: onnx.ValueInfoProto) -> TensorSpec:
        tt = vi.type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).name if tt.elem_type else "unknown"
        shape = tuple(d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim)
        return TensorSpec(vi.name, dtype, shape)

    inits = {i.name for i in model.graph.initializer}
    inputs = [spec(v) for v in model.graph.input if v.name not in inits]
    outputs = [spec(v) for v in model.graph.output]
    opset = {(o.domain or "ai.onnx"): o.version for o in model.opset_import}
    ops: Counter[str] = Counter()

    def walk(graph: onnx.GraphProto) -> None:
        for node in graph.node:
            ops[node.op_type if not node.domain else f"{node.domain}.{node.op_type}"] += 1
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    walk(attr.g)
                for g in attr.graphs:
                    walk(g)

    walk(model.graph)
    return inputs, outputs, opset, dict(ops.most_common())


def _ir_ops(xml_path: Path) -> dict[str, int]:
    # Reading layer types from the XML needs no OpenVINO install.
    root = ET.parse(xml_path).getroot()
    return dict(Counter(layer.get("type", "?") for layer in root.iter("layer")).most_common())


def inspect_model(path: Path, work_dir: Path, override: Format | None = None) -> ModelSummary:
    """Return a summary of the model at ``path`` (its format detected from content)."""
    source = open_source(path, work_dir, override)
    notes: list[str] = []
    quantization: dict[str, dict[str, float | int]] = {}
    opset: dict[str, int] = {}
    ops: dict[str, int] = {}
    if source.format is Format.ONNX:
        inputs, outputs, opset, ops = _onnx_summary(source.path)
    else:
        from services.errors import EngineUnavailable, InvalidSpec
        from services.runners import open_runner

        if source.format is Format.OPENVINO_IR:
            ops = _ir_ops(source.path)
        try:
            runner = open_runner(source.format, source.path)
            # As the file declares them (a runner may exchange floats and quantise at the boundary).
            declared = runner.io_contract()
            runner.close()
            inputs = [TensorSpec.from_dict(t) for t in declared["inputs"]]
            outputs = [TensorSpec.from_dict(t) for t in declared["outputs"]]
            quantization = {
                t["name"]: dict(t["quantization"])
                for t in [*declared["inputs"], *declared["outputs"]]
                if t.get("quantization")
            }
        except (EngineUnavailable, InvalidSpec) as exc:
            # A scripted TorchScript has no recorded shapes; inspect has no spec to give it.
            inputs, outputs = [], []
            notes.append(f"signature unavailable: {exc.message}")
    return ModelSummary(
        format=source.format.value,
        seen=source.seen,
        sha256=source.sha256,
        inputs=inputs,
        outputs=outputs,
        opset=opset,
        ops=ops,
        notes=notes,
        quantization=quantization,
    )
