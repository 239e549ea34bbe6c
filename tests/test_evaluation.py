"""Evaluation on labelled data (spec.evaluation): the metrics, the file's layouts and refusals, the drop gate.

The metrics are checked on arrays small enough to count by hand; the gate on a tiny ONNX
classifier compiled end to end (the source scored in the reference step, each artifact in its
export), its reported scores checked against the published artifact run here independently.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from services.errors import InvalidSpec
from services.pipeline import compile_model
from services.spec import EvaluationSpec, load_spec
from services.tensors import TensorSpec
from services.validation.evaluation import inspect_evaluation_file, load_evaluation
from services.validation.task_metrics import check_labels, score


def _spec(**fields: Any) -> EvaluationSpec:
    return EvaluationSpec(data="eval.npz", **fields)


# --- the metrics, by hand ---------------------------------------------------------------------


def test_top1_counts_each_sample_once_over_feeds_of_unequal_size() -> None:
    # Feed 0: 3 samples, 2 right; feed 1: 1 sample, wrong. Pooled: 2 of 4, not the mean of 2/3 and 0.
    outputs = [np.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]]), np.array([[0.6, 0.4]])]
    labels = [np.array([1, 0, 0]), np.array([1])]
    got = score(outputs, labels, _spec(metric="top1"))
    assert got.value == pytest.approx(0.5) and got.counted == 4
    assert got.per_feed == pytest.approx([2 / 3, 0.0])


def test_topk_counts_the_label_among_the_k_highest() -> None:
    logits = np.array([[3.0, 2.0, 1.0], [1.0, 2.0, 3.0], [2.0, 3.0, 1.0], [5.0, 5.0, 1.0]])
    labels = np.array([2, 0, 0, 1])  # third of 3, third of 3, second of 3, tied first
    assert score([logits], [labels], _spec(metric="topk", k=2)).value == pytest.approx(2 / 4)
    assert score([logits], [labels], _spec(metric="topk", k=3)).value == pytest.approx(1.0)
    # top1 is the argmax, which takes the first of tied classes: sample 3's label 1 loses the tie there.
    assert score([logits], [labels], _spec(metric="top1")).value == 0.0
    assert score([logits], [labels], _spec(metric="topk", k=1)).value == pytest.approx(1 / 4)


def test_top1_per_position_ignores_padding_and_reads_the_class_axis() -> None:
    # [N=2, T=3, V=2] logits; sample 1's last position is padding (-1).
    logits = np.array([[[0, 1], [1, 0], [0, 1]], [[1, 0], [1, 0], [0, 1]]], dtype=np.float32)
    labels = np.array([[1, 1, 1], [0, 1, -1]])
    got = score([logits], [labels], _spec(metric="top1_per_position"))
    assert got.value == pytest.approx(3 / 5) and got.counted == 5
    # The same logits time-major ([T, N, V]) would need labels [T, N]; classes on axis 1 of [N, V, T]:
    channels_first = np.moveaxis(logits, 2, 1)
    assert score([channels_first], [labels], _spec(metric="top1_per_position", class_axis=1)).value == pytest.approx(
        3 / 5
    )


def test_mse_and_mae_pool_every_element() -> None:
    outputs = [np.array([[1.0, 2.0], [3.0, 4.0]]), np.array([[0.0, 0.0]])]
    labels = [np.ones((2, 2)), np.array([[0.0, 2.0]])]
    # Errors 0, 1, 2, 3 and 0, -2: squared 0+1+4+9+0+4 = 18 over 6; absolute 0+1+2+3+0+2 = 8 over 6.
    assert score(outputs, labels, _spec(metric="mse")).value == pytest.approx(3.0)
    assert score(outputs, labels, _spec(metric="mae")).value == pytest.approx(8 / 6)


def test_iou_is_the_mean_of_each_samples_iou_at_the_threshold() -> None:
    maps = np.array([[[[0.9, 0.9], [0.1, 0.6]]], [[[0.2, 0.1], [0.1, 0.1]]]])  # [N=2, 1, 2, 2]
    masks = np.array([[[1, 0], [0, 1]], [[0, 0], [0, 0]]])  # [N, 2, 2]: one value per map value
    # Sample 0 at 0.5: predicted {00, 01, 11}, true {00, 11}: IoU 2/3. Sample 1: both empty, 1.0.
    assert score([maps], [masks], _spec(metric="iou")).value == pytest.approx((2 / 3 + 1.0) / 2)
    # At 0.95 nothing is predicted: sample 0 has IoU 0.
    assert score([maps], [masks], _spec(metric="iou", threshold=0.95)).value == pytest.approx(0.5)


def test_a_nan_output_is_not_a_score() -> None:
    got = score([np.array([[np.nan, 1.0]])], [np.array([[0.0, 1.0]])], _spec(metric="mse"))
    assert not got.finite and got.nonfinite == 1


@pytest.mark.parametrize(
    ("fields", "output", "labels", "words"),
    [
        ({"metric": "top1"}, np.zeros((2, 3)), np.zeros((2, 1), np.int64), "needs [2]"),
        ({"metric": "top1"}, np.zeros((2, 3)), np.zeros(2), "integer class indices"),
        ({"metric": "top1"}, np.zeros((2, 3)), np.array([0, 3]), "3 classes"),
        ({"metric": "top1"}, np.zeros((2, 3)), np.array([0, -1]), "only top1_per_position"),
        ({"metric": "top1"}, np.zeros((2, 4, 3)), np.zeros((2, 4), np.int64), "use top1_per_position"),
        ({"metric": "topk", "k": 5}, np.zeros((2, 3)), np.array([0, 1]), "evaluation.k is 5"),
        ({"metric": "top1_per_position"}, np.zeros((2, 3)), np.array([0, 1]), "needs positions"),
        ({"metric": "mse"}, np.zeros((2, 3)), np.zeros((2, 4)), "one label per output value"),
        ({"metric": "iou"}, np.zeros((2, 1, 2, 2)), np.full((2, 2, 2), 0.5), "0 (background) and 1"),
    ],
)
def test_labels_that_cannot_be_scored_are_refused(
    fields: dict[str, Any], output: np.ndarray, labels: np.ndarray, words: str
) -> None:
    with pytest.raises(InvalidSpec) as info:
        check_labels([output], [labels], _spec(**fields))
    assert words in info.value.message, info.value.message
    assert info.value.hint and info.value.details["errors"][0]["field"] == "evaluation.data"


# --- the file ---------------------------------------------------------------------------------

_X = TensorSpec("x", "float32", (None, 4))


def test_by_input_name_layout_batches_one_sample_per_feed(tmp_path: Path) -> None:
    path = tmp_path / "eval.npz"
    np.savez(path, x=np.arange(12, dtype=np.float64).reshape(3, 4), labels=np.array([0, 1, 2]))
    data = load_evaluation(path, [_X], load_spec({"targets": ["onnxruntime"]}))
    assert data.samples == 3 and data.layout == "by input name" and len(data.feeds) == 3
    assert data.feeds[1]["x"].dtype == np.float32 and data.feeds[1]["x"].tolist() == [[4, 5, 6, 7]]
    assert [lab.tolist() for lab in data.labels] == [[0], [1], [2]]


def test_whole_feed_layout_keeps_each_samples_own_shape(tmp_path: Path) -> None:
    path = tmp_path / "eval.npz"
    seq = TensorSpec("x", "float32", (None, None))
    np.savez(path, **{"0/x": np.zeros((1, 5)), "0/labels": np.array([1]), "1/x": np.zeros((1, 9)), "1/labels": [0]})
    data = load_evaluation(path, [seq], load_spec({"targets": ["onnxruntime"]}))
    assert data.layout == "whole feeds" and [f["x"].shape for f in data.feeds] == [(1, 5), (1, 9)]


def _pickled(path: Path) -> None:
    np.savez(path, x=np.zeros((2, 4)), labels=np.array([{"a": 1}, {"b": 2}], dtype=object))


@pytest.mark.parametrize(
    ("write", "words"),
    [
        (lambda p: p.write_bytes(b"not a zip"), "not a readable .npz"),
        (_pickled, "never unpickles"),
        (lambda p: np.savez(p, x=np.zeros((2, 4))), "no `labels` array"),
        (lambda p: np.savez(p, x=np.zeros((2, 4)), labels=np.zeros(3)), "same non-zero number of samples"),
        (lambda p: np.savez(p, image=np.zeros((2, 4)), labels=np.zeros(2)), "the model takes ['x']"),
        (lambda p: np.savez(p, **{"0/x": np.zeros((1, 4))}), "no '<sample>/labels' array"),
        (lambda p: np.savez(p, x=np.zeros((2, 5)), labels=np.zeros(2)), "sample shape [5]"),
    ],
)
def test_bad_files_are_refused_with_the_layout(tmp_path: Path, write: Any, words: str) -> None:
    path = tmp_path / "eval.npz"
    write(path)
    with pytest.raises(InvalidSpec) as info:
        load_evaluation(path, [_X], load_spec({"targets": ["onnxruntime"]}))
    assert words in info.value.message, info.value.message
    assert "numpy.savez" in info.value.hint or "Give" in info.value.hint or "Score" in info.value.hint


def test_a_pickle_in_disguise_is_never_loaded(tmp_path: Path) -> None:
    path = tmp_path / "eval.npz"
    path.write_bytes(pickle.dumps({"labels": [1, 2]}))
    with pytest.raises(InvalidSpec, match=r"not a readable \.npz"):
        inspect_evaluation_file(path)


# --- end to end: the source and each artifact scored, the drop judged ----------------------------


def _classifier(path: Path, seed: int = 0) -> tuple[Path, np.ndarray]:
    """Write a one-Gemm classifier x[N,16] -> logits[N,4]; return it and its weights."""
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((16, 4)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W"], ["logits"])],
        "classifier",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 4])],
        [numpy_helper.from_array(weights, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path, weights


def _run(model: Path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return np.concatenate([session.run(None, {"x": x[i : i + 1]})[0] for i in range(len(x))])


def test_source_and_artifact_are_scored_and_the_manifest_says_so(
    tmp_path: Path, store, repository, repo_dir: Path
) -> None:
    model, weights = _classifier(tmp_path / "classifier.onnx")
    x = np.random.default_rng(1).standard_normal((40, 16)).astype(np.float32)
    labels = (x @ weights).argmax(axis=1)
    labels[:6] = (labels[:6] + 1) % 4  # six wrong labels: the source itself scores 34/40
    np.savez(tmp_path / "eval.npz", x=x, labels=labels)
    spec = load_spec(
        {
            "targets": ["onnxruntime", "openvino"],
            "name": "classifier",
            "benchmark": False,
            "evaluation": {"data": str(tmp_path / "eval.npz"), "metric": "top1", "max_drop": 0.0},
        }
    )
    result = compile_model(model, spec, store=store, repository=repository)
    for name in ("onnxruntime", "openvino"):
        target = result.targets[name]
        assert target.status == "succeeded", target.error
        ev = target.evaluation
        assert ev is not None
        assert ev["source"] == pytest.approx(34 / 40) and ev["artifact"] == pytest.approx(34 / 40)
        assert ev["drop"] == 0 and ev["passed"] is True and ev["samples"] == 40 and ev["output"] == "logits"
        version_dir = repo_dir / "triton" / f"classifier-{name}" / "1"
        manifest = json.loads((version_dir / "kiln-manifest.json").read_text())
        assert manifest["evaluation"] == ev


def test_a_drop_past_max_drop_fails_the_target_with_both_scores(
    tmp_path: Path, store, repository, repo_dir: Path
) -> None:
    model, weights = _classifier(tmp_path / "classifier.onnx")
    x = np.random.default_rng(2).standard_normal((48, 16)).astype(np.float32)
    expected = x @ weights  # the source gives exactly these: its MSE against them is 0
    np.savez(tmp_path / "eval.npz", x=x, labels=expected)
    spec = load_spec(
        {
            "targets": ["onnxruntime"],
            "precision": "fp16",
            "name": "classifier",
            "benchmark": False,
            "evaluation": {"data": str(tmp_path / "eval.npz"), "metric": "mse", "max_drop": 0.0},
        }
    )
    result = compile_model(model, spec, store=store, repository=repository)
    target = result.targets["onnxruntime"]
    assert target.status == "failed" and target.error["code"] == "ACCURACY_DROP_EXCEEDED"
    ev = target.error["details"]["evaluation"]
    assert target.evaluation == ev and ev["passed"] is False
    # fp16 weights round the logits: an MSE above the source's 0.
    assert ev["source"] == pytest.approx(0.0, abs=1e-10) and ev["artifact"] > 0 and ev["drop"] == ev["artifact"]
    assert "mse" in target.error["message"] and "max_drop 0.0" in target.error["message"]
    assert target.published is None
    # With room for fp16's rounding the same artifact publishes, its score the one reported above.
    loose = spec.model_copy(update={"evaluation": spec.evaluation.model_copy(update={"max_drop": 1e-3})})
    result = compile_model(model, loose, store=store, repository=repository)
    target = result.targets["onnxruntime"]
    assert target.status == "succeeded", target.error
    published = repo_dir / "triton" / "classifier" / str(target.published["version"]) / "model.onnx"
    independent = float(np.mean((_run(published, x).astype(np.float64) - expected) ** 2))
    assert target.evaluation["artifact"] == pytest.approx(independent, rel=1e-4)
    assert target.evaluation["artifact"] == pytest.approx(ev["artifact"], rel=1e-6)


def test_tune_keeps_only_candidates_within_the_accuracy_floor(tmp_path: Path) -> None:
    from services.storage import LocalArtifactStore
    from services.tune import TuneRequest, tune_model

    model, weights = _classifier(tmp_path / "classifier.onnx")
    x = np.random.default_rng(3).standard_normal((32, 16)).astype(np.float32)
    np.savez(tmp_path / "eval.npz", x=x, labels=x @ weights)  # the source's own logits: its MSE is 0
    req = TuneRequest(
        model=model,
        targets=["onnxruntime"],
        precisions=["fp32", "fp16"],
        spec_data={"evaluation": {"data": str(tmp_path / "eval.npz"), "metric": "mse", "max_drop": 0.0}},
        rounds=5,
        warmup=1,
        profile=False,
        race=False,
    )
    body = tune_model(req, store=LocalArtifactStore(tmp_path / "store")).to_dict()
    built = {b["precision"]: b for b in body["built"]}
    # fp16 rounds the logits: past a floor of no loss at all, pruned with both scores, never timed.
    assert built["fp16"]["status"] == "pruned" and built["fp16"]["error"]["code"] == "ACCURACY_DROP_EXCEEDED"
    assert built["fp16"]["evaluation"]["drop"] > 0 and built["fp16"]["evaluation"]["passed"] is False
    assert built["fp32"]["status"] == "built" and built["fp32"]["evaluation"]["drop"] == 0
    assert all(c["p50_ms"] is None for c in body["candidates"] if c["precision"] == "fp16")
    rec = body["recommendation"]
    assert rec["precision"] == "fp32" and rec["evaluation"]["passed"] is True


def test_labels_the_source_cannot_be_scored_on_are_refused_by_the_reference_step(
    tmp_path: Path, store, repository
) -> None:
    model, _ = _classifier(tmp_path / "classifier.onnx")
    x = np.zeros((6, 16), np.float32)
    np.savez(tmp_path / "eval.npz", x=x, labels=np.zeros((6, 2), np.int64))  # two labels a sample: not top1
    spec = load_spec(
        {
            "targets": ["onnxruntime"],
            "name": "classifier",
            "benchmark": False,
            "evaluation": {"data": str(tmp_path / "eval.npz"), "metric": "top1"},
        }
    )
    target = compile_model(model, spec, store=store, repository=repository).targets["onnxruntime"]
    assert target.status == "failed" and target.error["code"] == "INVALID_SPEC"
    assert "labels are [1, 2], the output [1, 4] needs [1]" in target.error["message"]
    assert "labels" in target.error["hint"]
