"""Parity metrics, inputs from calibration files or seeds, benchmark figures."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from services.errors import InvalidSpec, ParityFailed
from services.runners import TensorSpec
from services.spec import Tolerances, load_spec
from services.validation import check_parity, compare_outputs, load_calibration, make_validation_inputs, resolve_shape


def test_metrics_are_computed() -> None:
    ref = [np.array([[1.0, 2.0, 3.0]]), np.array([[3.0, 1.0, 0.0]])]
    act = [np.array([[1.0, 2.1, 3.0]]), np.array([[0.0, 1.0, 3.0]])]
    p = compare_outputs("y", act, ref, Tolerances(atol=0.01, rtol=0.0))
    assert p.max_abs == pytest.approx(3.0)
    assert p.top1 == 0.5  # second sample's argmax moved
    assert 0 < p.cosine < 1
    assert p.within_allclose is False


def test_check_parity_raises_with_numbers() -> None:
    ref = [{"y": np.ones((1, 4), np.float32)}]
    act = [{"y": np.ones((1, 4), np.float32) * 1.5}]
    with pytest.raises(ParityFailed) as exc:
        check_parity(act, ref, Tolerances(atol=1e-3, rtol=1e-3, min_cosine=0.99), inputs_from="test")
    parity = exc.value.details["parity"]
    assert parity["outputs"][0]["max_abs"] == pytest.approx(0.5)
    assert parity["passed"] is False
    ok = check_parity(ref, ref, Tolerances(atol=0, rtol=0, min_cosine=1.0, min_top1=1.0), inputs_from="test")
    assert ok.passed and ok.outputs[0].max_abs == 0.0


def test_outputs_matched_by_position_when_renamed() -> None:
    ref = [{"dense": np.array([[1.0, 0.0]]), "aux": np.array([[5.0]])}]
    act = [{"output_0": np.array([[1.0, 0.0]]), "output_1": np.array([[5.0]])}]
    report = check_parity(act, ref, Tolerances(atol=0, rtol=0), inputs_from="t")
    assert [o.name for o in report.outputs] == ["dense", "aux"]


def test_resolve_shape_and_seeded_inputs() -> None:
    t = TensorSpec("input", "float32", (None, 3, None, None))
    spec = load_spec({"targets": ["onnxruntime"]})
    assert resolve_shape(t, spec) == [1, 3, 16, 16]
    spec2 = load_spec({"targets": ["onnxruntime"], "inputs": {"input": {"shape": [2, 3, 8, 8]}}})
    assert resolve_shape(t, spec2) == [2, 3, 8, 8]
    bad = load_spec({"targets": ["onnxruntime"], "inputs": {"input": {"shape": [2, 4, 8, 8]}}})
    with pytest.raises(InvalidSpec, match="axis 1 is fixed at 3"):
        resolve_shape(t, bad)
    a, src = make_validation_inputs([t], spec)
    b, _ = make_validation_inputs([t], spec)
    assert len(a) == 8 and "seeded" in src
    assert np.array_equal(a[3]["input"], b[3]["input"])
    ids = TensorSpec("input_ids", "int64", (None, None))
    mask = TensorSpec("attention_mask", "int64", (None, None))
    feeds, _ = make_validation_inputs([ids, mask], spec)
    assert feeds[0]["input_ids"].dtype == np.int64 and feeds[0]["attention_mask"].min() == 1


def test_calibration_matched_by_name(tmp_path: Path) -> None:
    a = TensorSpec("a", "float32", (None, 2))
    b = TensorSpec("b", "float32", (None, 3))
    path = tmp_path / "c.npz"
    np.savez(path, b=np.zeros((5, 3), np.float32), a=np.ones((5, 2), np.float32))
    data = load_calibration(path, [a, b])
    feeds, src = make_validation_inputs([a, b], load_spec({"targets": ["onnxruntime"]}), data)
    assert src == "calibration" and len(feeds) == 5
    assert feeds[0]["a"].shape == (1, 2) and feeds[0]["a"][0, 0] == 1.0 and feeds[0]["b"].shape == (1, 3)
    np.savez(tmp_path / "wrong.npz", x=np.zeros((5, 2)))
    with pytest.raises(InvalidSpec, match="do not match the model inputs"):
        load_calibration(tmp_path / "wrong.npz", [a, b])
    (tmp_path / "junk.npz").write_bytes(b"junk")
    with pytest.raises(InvalidSpec, match="not a readable"):
        load_calibration(tmp_path / "junk.npz", [a])
