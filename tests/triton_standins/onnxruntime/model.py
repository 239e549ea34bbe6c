"""TEST-ONLY STAND-IN for NVIDIA's Triton onnxruntime backend (libtriton_onnxruntime.so).

NVIDIA's backend library is not installable on Kiln's machines; this Python-based backend
takes its place so that Kiln's published ``triton/<name>`` directories (``config.pbtxt`` with
``platform: "onnxruntime_onnx"``, ``1/model.onnx``) load unchanged in the real Triton core and
answer inferences. It runs ``<version>/<default_model_filename or model.onnx>`` on the real
onnxruntime CPU provider. Like the real backend, when the model batches (``max_batch_size >
0``) the requests Triton's dynamic batcher hands over together are concatenated along the
batch axis, run once and split back.

Like the real backend (its ``ValidateInputs``/``ValidateOutputs``), loading checks the config
against the model: every configured tensor must exist in the model with the same data type and
a compatible shape (the batch axis counted when ``max_batch_size > 0``), else the load fails
with a message saying what differs. The messages are this stand-in's, not NVIDIA's.

It runs inside Triton's Python backend stub (the tool venv's interpreter, see
tests/triton_server.py), not in Kiln's venv.
"""

from __future__ import annotations

import json
import os

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils

_ORT_TYPES = {
    "tensor(bool)": "TYPE_BOOL",
    "tensor(uint8)": "TYPE_UINT8",
    "tensor(uint16)": "TYPE_UINT16",
    "tensor(uint32)": "TYPE_UINT32",
    "tensor(uint64)": "TYPE_UINT64",
    "tensor(int8)": "TYPE_INT8",
    "tensor(int16)": "TYPE_INT16",
    "tensor(int32)": "TYPE_INT32",
    "tensor(int64)": "TYPE_INT64",
    "tensor(float16)": "TYPE_FP16",
    "tensor(float)": "TYPE_FP32",
    "tensor(double)": "TYPE_FP64",
    "tensor(string)": "TYPE_STRING",
    "tensor(bfloat16)": "TYPE_BF16",
}


def _check(configured: list, model_io: list, batching: bool, kind: str) -> None:
    """Fail the load when the config's tensors disagree with the model's (name, data type, shape)."""
    by_name = {t.name: t for t in model_io}
    for t in configured:
        name = t["name"]
        if name not in by_name:
            raise pb_utils.TritonModelException(
                f"stand-in onnxruntime: configured {kind} '{name}' is not in the model ({sorted(by_name)})"
            )
        found = by_name[name]
        if _ORT_TYPES.get(found.type) != t["data_type"]:
            raise pb_utils.TritonModelException(
                f"stand-in onnxruntime: {kind} '{name}' is {t['data_type']} in the config, {found.type} in the model"
            )
        # The model sees the reshape's shape when there is one; Triton adds the batch axis.
        dims = [int(d) for d in (t["reshape"]["shape"] if "reshape" in t else t["dims"])]
        dims = [-1, *dims] if batching else dims
        model = [d if isinstance(d, int) else -1 for d in found.shape]
        if len(dims) != len(model) or any(m != -1 and c != m for c, m in zip(dims, model, strict=True)):
            raise pb_utils.TritonModelException(
                f"stand-in onnxruntime: {kind} '{name}' has shape {dims} in the config "
                f"(batch axis included), {model} in the model"
            )


class TritonPythonModel:
    """Stand-in for Triton's onnxruntime backend (test only)."""

    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        filename = config.get("default_model_filename") or "model.onnx"
        path = os.path.join(args["model_repository"], args["model_version"], filename)
        self.session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        self.batching = int(config.get("max_batch_size", 0)) > 0
        self.inputs = [t["name"] for t in config["input"]]
        self.outputs = [t["name"] for t in config["output"]]
        _check(config["input"], self.session.get_inputs(), self.batching, "input")
        _check(config["output"], self.session.get_outputs(), self.batching, "output")
        pb_utils.Logger.log_info(
            f"kiln stand-in onnxruntime backend: onnxruntime {ort.__version__}, numpy {np.__version__}, {path}"
        )

    def execute(self, requests: list) -> list:
        feeds = [{n: pb_utils.get_input_tensor_by_name(r, n).as_numpy() for n in self.inputs} for r in requests]
        if self.batching and len(feeds) > 1:
            sizes = [f[self.inputs[0]].shape[0] for f in feeds]
            merged = {n: np.concatenate([f[n] for f in feeds]) for n in self.inputs}
            results = self.session.run(self.outputs, merged)
            bounds = np.cumsum(sizes)[:-1]
            per_request = zip(*(np.split(r, bounds) for r in results), strict=True)
        else:
            per_request = (self.session.run(self.outputs, f) for f in feeds)
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor(n, np.ascontiguousarray(v)) for n, v in zip(self.outputs, out, strict=True)]
            )
            for out in per_request
        ]
