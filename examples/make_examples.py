"""Regenerate examples/tiny_cnn.onnx: a 10-class CNN with random weights (seed 0).

It is exported without torch's own graph optimisation, so BatchNorm, Identity-like and
constant-shape nodes are still there for Kiln's optimizer to fold — the demo shows that work.
Run: .venv/bin/python examples/make_examples.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "tests"))

from models import tiny_cnn_module  # noqa: E402


def main() -> None:
    model = tiny_cnn_module()
    torch.onnx.export(
        model,
        (torch.randn(1, 3, 32, 32),),
        str(HERE / "tiny_cnn.onnx"),
        input_names=["input"],
        output_names=["logits"],
        dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
        opset_version=17,
        dynamo=False,
        training=torch.onnx.TrainingMode.PRESERVE,  # keep BatchNormalization unfused
        do_constant_folding=False,
    )
    print(f"wrote {HERE / 'tiny_cnn.onnx'}")


if __name__ == "__main__":
    main()
