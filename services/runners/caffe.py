"""Caffe models run by OpenCV's dnn module: the reference path, independent of Kiln's converter.

OpenCV has its own Caffe importer (C++, its own copy of caffe.proto) and its own layer
implementations, so parity compares Kiln's ONNX conversion against code that shares none of
it. The files are vetted by :func:`services.formats.caffe.load_caffe_net` before OpenCV reads
them, and the inputs and outputs (names, shapes) come from that vetted net.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from services.errors import EngineUnavailable, SourceUnreadable
from services.formats.caffe import load_caffe_net
from services.runners.base import ModelRunner, TensorSpec, contiguous

__all__ = ["CaffeRunner"]


class CaffeRunner(ModelRunner):
    """A vetted Caffe net loaded by ``cv2.dnn.readNetFromCaffe``, batch axis open."""

    def __init__(self, path: Path, **_: Any) -> None:
        try:
            import cv2
        except ImportError as exc:  # pragma: no cover - the onnxruntime image carries it
            raise EngineUnavailable(
                "OpenCV (opencv-python-headless) is not installed: it runs Caffe sources",
                hint="Install Kiln's onnxruntime extra.",
            ) from exc
        self.net_def = load_caffe_net(Path(path))
        try:
            self._net = cv2.dnn.readNetFromCaffe(str(self.net_def.prototxt), str(self.net_def.caffemodel))
        except cv2.error as exc:
            raise SourceUnreadable(
                f"OpenCV could not read the Caffe net: {str(exc).strip()[-400:]}",
                hint="Check that the .prototxt is the deploy net that goes with the .caffemodel.",
            ) from exc
        self._net.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
        self._net.setPreferableTarget(cv2.dnn.DNN_TARGET_CPU)
        self.inputs = [TensorSpec(n, "float32", (None, *s[1:])) for n, s in self.net_def.inputs.items()]
        # The layer that last writes each output blob: OpenCV's forward() takes layer names.
        writer: dict[str, str] = {}
        for layer in self.net_def.layers:
            for top in layer.tops:
                writer[top] = layer.name
        self._out_layers = [writer[o] for o in self.net_def.outputs]
        self._cv2 = cv2
        # Output shapes from one run at the deploy net's own input shapes (OpenCV reports none before).
        probe = self.run(
            {n: np.zeros(s, np.float32) for n, s in self.net_def.inputs.items()}, _names=self.net_def.outputs
        )
        self.outputs = [TensorSpec(o, "float32", (None, *probe[o].shape[1:])) for o in self.net_def.outputs]

    def run(self, feeds: dict[str, np.ndarray], _names: list[str] | None = None) -> dict[str, np.ndarray]:
        for spec in self.inputs:
            self._net.setInput(contiguous(feeds[spec.name], dtype=np.float32), spec.name)
        try:
            results = self._net.forward(self._out_layers)
        except self._cv2.error as exc:
            raise SourceUnreadable(f"OpenCV could not run the Caffe net: {str(exc).strip()[-400:]}") from exc
        names = _names or [o.name for o in self.outputs]
        return {n: np.array(r, dtype=np.float32) for n, r in zip(names, results, strict=True)}
