"""Text models on fixed-shape engines (issue 30, item 3): the artifact says which lengths it serves.

onnx2tf cannot keep a transformer's sequence axis open (its mask arithmetic loses ranks), so
TFLite and TF Serving artifacts of text models are built at one length: the spec's `inputs`
shape, else 16. The warning names that length, the padding that serves shorter sequences and
how to build another; a length given in `inputs` is the one built, and served correctly.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kiln_testing import modern_matrix as mx
from kiln_testing import modern_models as mm
from services.pipeline import compile_model
from services.spec import load_spec

# find_spec, not importorskip: importing onnx2tf raises the whole test run's recursion limit to
# C int's maximum (see services/converters/onnx_to_tensorflow.py), which turned the API tests'
# deeply nested body from a RecursionError into a segfault of the run.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("onnx2tf") is None, reason="the tensorflow extra is not installed"
)


@pytest.mark.parametrize("length", [None, 24])
def test_a_text_model_on_tflite_serves_the_length_it_says(length: int | None, store, repository, tmp_path) -> None:
    fam = mm.family("t5-encoder")
    src = mm.build_checkpoint(fam, tmp_path)
    body: dict[str, object] = {
        "targets": ["tflite"],
        "name": "t5",
        "benchmark": False,
        "validation": {"samples": 2},
        "options": {"huggingface": {"task": fam.task}},
    }
    if length is not None:
        body["inputs"] = {n: {"shape": [1, length]} for n in ("input_ids", "attention_mask")}
    result = compile_model(src, load_spec(body), store=store, repository=repository)
    target = result.targets["tflite"]
    assert target.status == "succeeded", target.error
    served = length or 16
    if length is None:
        (warning,) = [w for w in target.warnings if w.startswith("fixed-shape artifact")]
        assert f"It serves sequences of exactly {served} tokens" in warning
        assert "pad a shorter one to that length with attention_mask 0" in warning
        assert "compile with `inputs.input_ids.shape` at it (e.g. [1, 128])" in warning
    version = Path(target.published["uri"].removeprefix("file://"))
    check = mx.check_artifact(fam, src, mx.open_artifact("tflite", version))
    assert check["ok"] and check["lengths"] == [served], check
