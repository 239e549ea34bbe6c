"""Parity metrics, inputs from calibration files or seeds, benchmark figures."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from services.errors import InvalidSpec, ParityFailed
from services.runners import TensorSpec
from services.spec import DEFAULT_TOLERANCES, Precision, Tolerances, load_spec
from services.validation import check_parity, compare_outputs, load_calibration, make_validation_inputs, resolve_shape
from services.validation.parity import OutputParity, verdict_failures


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


_RELAXED = Tolerances(atol=1e9, rtol=1e9, min_cosine=-1.0, min_top1=0.0)


@pytest.mark.parametrize(
    "tol",
    [
        DEFAULT_TOLERANCES[Precision.FP32],
        DEFAULT_TOLERANCES[Precision.FP16],
        DEFAULT_TOLERANCES[Precision.INT8],
        _RELAXED,
    ],
    ids=["fp32", "fp16", "int8", "relaxed"],
)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("where", ["one", "all"])
def test_nonfinite_values_the_source_lacks_fail_at_every_tolerance(tol: Tolerances, bad: float, where: str) -> None:
    rng = np.random.default_rng(0)
    ref = [{"y": rng.standard_normal((2, 5)).astype(np.float32)} for _ in range(3)]
    act = [{"y": r["y"].copy()} for r in ref]
    if where == "all":
        for a in act:
            a["y"][:] = bad
    else:
        act[1]["y"][0, 2] = bad
    report = check_parity(act, ref, tol, inputs_from="t", raise_on_failure=False)
    assert report.passed is False
    out = report.outputs[0]
    # ``values`` counts only the pairs compared (both finite), never the disagreeing ones.
    assert out.nonfinite == (30 if where == "all" else 1) and out.values == 30 - out.nonfinite
    assert any("NaN or infinite" in f for f in report.failures)
    assert "no tolerance accepts" in (report.hint() or "")
    # The report stays JSON-safe and its metrics stay numbers (taken over the finite values).
    assert json.loads(json.dumps(report.to_dict()))["outputs"][0]["nonfinite"] == out.nonfinite
    with pytest.raises(ParityFailed) as exc:
        check_parity(act, ref, tol, inputs_from="t")
    assert exc.value.details["parity"]["passed"] is False


def test_nonfinite_values_the_source_has_too_agree() -> None:
    ref = [{"y": np.array([[1.0, np.nan, np.inf, -np.inf]], np.float32)}]
    report = check_parity(ref, ref, DEFAULT_TOLERANCES[Precision.FP32], inputs_from="t", raise_on_failure=False)
    assert report.passed, report.failures
    assert report.outputs[0].nonfinite == 0 and report.outputs[0].cosine == 1.0
    # NaN where the source has +inf, or a number where the source has NaN, is a disagreement.
    swapped = [{"y": np.array([[1.0, 2.0, np.nan, -np.inf]], np.float32)}]
    report = check_parity(swapped, ref, _RELAXED, inputs_from="t", raise_on_failure=False)
    assert not report.passed and report.outputs[0].nonfinite == 2


def test_a_nan_metric_cannot_pass_a_bound() -> None:
    # Every bound fails a NaN metric, however the metric came to be NaN.
    nan_out = OutputParity("y", 0.0, 0.0, float("nan"), float("nan"), True, values=4)
    failures = verdict_failures([nan_out], _RELAXED)
    assert any("cosine" in f for f in failures) and any("top-1" in f for f in failures)


@pytest.mark.parametrize("tol", [DEFAULT_TOLERANCES[Precision.INT8], _RELAXED], ids=["int8", "relaxed"])
def test_nothing_compared_is_a_failure(tol: Tolerances) -> None:
    no_outputs = check_parity([{}, {}], [{}, {}], tol, inputs_from="t", raise_on_failure=False)
    assert not no_outputs.passed and "nothing to compare" in no_outputs.failures[0]
    empty = [{"y": np.zeros((1, 0), np.float32)}]
    assert not check_parity(empty, empty, tol, inputs_from="t", raise_on_failure=False).passed
    with pytest.raises(ParityFailed, match="no samples"):
        check_parity([], [], tol, inputs_from="t")


def test_feeds_pair_by_spelling_before_position() -> None:
    # onnx2tf respells past_key_values.0.key as past_key_values_0_key, and a SavedModel's
    # signature lists inputs in its own order: position alone would swap key and value.
    from types import SimpleNamespace

    from services.exporters._common import adapt_feed

    feed = {
        "input_ids": np.zeros((1, 3), np.int64),
        "past_key_values.0.key": np.full((1, 2), 1.0, np.float32),
        "past_key_values.0.value": np.full((1, 2), 2.0, np.float32),
    }
    artifact = SimpleNamespace(
        inputs=[
            TensorSpec("past_key_values_0_value", "float32", (None, 2)),
            TensorSpec("input_ids", "int32", (None, 3)),
            TensorSpec("past_key_values_0_key", "float32", (None, 2)),
        ]
    )
    fed = adapt_feed(feed, artifact)  # type: ignore[arg-type]
    assert list(fed) == ["past_key_values_0_value", "input_ids", "past_key_values_0_key"]
    assert fed["past_key_values_0_value"][0, 0] == 2.0 and fed["past_key_values_0_key"][0, 0] == 1.0
    assert fed["input_ids"].dtype == np.int32


def test_a_failing_bound_is_printed_with_the_digits_that_make_it_true() -> None:
    """Issue 27: "Pearson 0.9999 < 0.9999" for 0.99987 read as a broken gate."""
    tol = Tolerances(min_pearson=0.9999, min_cosine=0.999999, min_snr_db=40.0, min_top1=1.0)
    o = OutputParity("y", 1e-3, 1e-3, 0.9999987, 0.9995, False, values=10, pearson=0.99987, snr_db=39.96)
    said = " ".join(verdict_failures([o], tol))
    assert "Pearson 0.99987 < 0.9999" in said
    assert "cosine 0.9999987 < 0.999999" in said
    assert "SNR 39.96 dB < 40 dB" in said
    assert "top-1 agreement 99.95% < 100%" in said


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_a_parity_hint_fits_the_precision(precision: str) -> None:
    a = [{"y": np.linspace(0, 1, 64, dtype=np.float32)}]
    e = [{"y": np.linspace(0, 1, 64, dtype=np.float32)[::-1].copy()}]
    report = check_parity(a, e, DEFAULT_TOLERANCES[Precision(precision)], inputs_from="test", raise_on_failure=False)
    assert not report.passed
    hint = report.hint(precision)
    assert hint is not None
    if precision == "fp32":
        assert "higher precision" not in hint and "conversion changed the model" in hint
    else:
        assert "higher precision" in hint and precision in hint
