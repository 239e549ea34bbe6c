"""TEST-ONLY STAND-IN for Triton's OpenVINO backend (libtriton_openvino.so).

NVIDIA's backend library is not installable on Kiln's machines; this Python-based backend
takes its place so that Kiln's published ``triton/<name>`` directories (``config.pbtxt`` with
``backend: "openvino"``, ``1/model.xml`` + ``model.bin``) load unchanged in the real Triton
core and answer inferences. It compiles ``<version>/<default_model_filename or model.xml>``
with the real OpenVINO runtime on the CPU at f32 (``INFERENCE_PRECISION_HINT``), the precision
Kiln's parity check used; the real backend has no such setting (README: "The model
repository"), so this does not show what the real backend computes on a bf16-capable CPU.
Loading checks each configured tensor's name and shape against the IR (``max_batch_size`` is
0, so dims are the full shape), failing with this stand-in's own message when they differ.
Kiln publishes OpenVINO models with ``max_batch_size: 0``: each request runs as it comes.
"""

from __future__ import annotations

import json
import os

import numpy as np
import openvino as ov
import triton_python_backend_utils as pb_utils


def _check(configured: list, ports: list, kind: str) -> None:
    """Fail the load when a configured tensor is missing from the IR or its shape disagrees."""
    for t in configured:
        name = t["name"]
        port = next((p for p in ports if name in p.get_names()), None)
        if port is None:
            names = sorted(n for p in ports for n in p.get_names())
            raise pb_utils.TritonModelException(
                f"stand-in openvino: configured {kind} '{name}' is not in the IR ({names})"
            )
        dims = [int(d) for d in (t["reshape"]["shape"] if "reshape" in t else t["dims"])]
        model = [d.get_length() if d.is_static else -1 for d in port.get_partial_shape()]
        if len(dims) != len(model) or any(m != -1 and c != m for c, m in zip(dims, model, strict=True)):
            raise pb_utils.TritonModelException(
                f"stand-in openvino: {kind} '{name}' has shape {dims} in the config, {model} in the IR"
            )


class TritonPythonModel:
    """Stand-in for Triton's OpenVINO backend (test only)."""

    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        filename = config.get("default_model_filename") or "model.xml"
        path = os.path.join(args["model_repository"], args["model_version"], filename)
        self.compiled = ov.Core().compile_model(path, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
        self.inputs = [t["name"] for t in config["input"]]
        self.outputs = [t["name"] for t in config["output"]]
        _check(config["input"], self.compiled.inputs, "input")
        _check(config["output"], self.compiled.outputs, "output")
        self.ports = {n: next(p for p in self.compiled.outputs if n in p.get_names()) for n in self.outputs}
        pb_utils.Logger.log_info(
            f"kiln stand-in openvino backend: openvino {ov.__version__}, numpy {np.__version__}, {path}"
        )

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            feed = {n: pb_utils.get_input_tensor_by_name(request, n).as_numpy() for n in self.inputs}
            result = self.compiled(feed)
            tensors = [pb_utils.Tensor(n, np.ascontiguousarray(result[self.ports[n]])) for n in self.outputs]
            responses.append(pb_utils.InferenceResponse(tensors))
        return responses
