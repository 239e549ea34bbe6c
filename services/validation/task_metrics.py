"""Task metrics on labelled data: top-1, top-k, per-position top-1, MSE, MAE and IoU of a thresholded map.

Each metric reads the scored output and the labels feed by feed: a feed holds one sample or a
batch of them on axis 0, and the feeds of a whole-feed file may differ in shape (text lines of
other widths), so nothing is concatenated. The whole set's value is pooled over every label
counted (a position, an element), not averaged over feeds of unequal size; IoU is the mean of
each sample's own IoU, as segmentation benchmarks report it. Each feed's own value comes with it:
NNCF's accuracy control ranks quantisers by how each item's value moves.

Labels are checked against the output before anything is scored (:func:`check_labels`), so a
file whose labels cannot mean what the metric needs is refused (INVALID_SPEC) with the shape it
should have, never scored as zero.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from services.errors import InvalidSpec
from services.spec import EvaluationMetric, EvaluationSpec

__all__ = ["Score", "check_labels", "score"]

_CLASSES = (EvaluationMetric.TOP1, EvaluationMetric.TOPK, EvaluationMetric.TOP1_PER_POSITION)
_ERRORS = (EvaluationMetric.MSE, EvaluationMetric.MAE)


@dataclass
class Score:
    """A metric's value over the whole set, what it counted, and each feed's own value."""

    value: float
    counted: int  # samples (top1, topk, iou), positions (top1_per_position) or elements (mse, mae)
    per_feed: list[float] = field(default_factory=list)
    nonfinite: int = 0  # feeds whose output held a NaN or an infinity

    @property
    def finite(self) -> bool:
        return math.isfinite(self.value) and not self.nonfinite


def _class_scores(output: np.ndarray, axis: int) -> np.ndarray:
    """Return ``output`` with its class axis last (a copy only when it moves)."""
    return np.moveaxis(np.asarray(output), axis, -1)


def _shape(a: np.ndarray) -> list[int]:
    return [int(d) for d in np.shape(a)]


def _class_problem(output: np.ndarray, labels: np.ndarray, spec: EvaluationSpec) -> str | None:
    if output.ndim < 2:
        return f"the output is {_shape(output)}: a class metric needs a batch axis and a class axis"
    if not -output.ndim <= spec.class_axis < output.ndim or spec.class_axis % output.ndim == 0:
        return f"evaluation.class_axis {spec.class_axis} is not a class axis of the output {_shape(output)}"
    scores = _class_scores(output, spec.class_axis)
    want = list(scores.shape[:-1])
    if spec.metric is not EvaluationMetric.TOP1_PER_POSITION and len(want) != 1:
        return (
            f"{spec.metric.value} scores one class per sample, but the output {_shape(output)} has "
            f"{len(want) - 1} more axis beside the batch and classes: use top1_per_position"
        )
    if spec.metric is EvaluationMetric.TOP1_PER_POSITION and len(want) < 2:
        return f"top1_per_position needs positions, but the output {_shape(output)} has one class vector per sample"
    if labels.dtype.kind not in "iub":
        return f"labels are {labels.dtype}: class labels are integer class indices"
    if _shape(labels) != want:
        return f"labels are {_shape(labels)}, the output {_shape(output)} needs {want} (a class index per " + (
            "position)" if spec.metric is EvaluationMetric.TOP1_PER_POSITION else "sample)"
        )
    classes = int(scores.shape[-1])
    if labels.size and int(labels.max()) >= classes:
        return f"a label is {int(labels.max())}, the output has {classes} classes (0 to {classes - 1})"
    if spec.metric is not EvaluationMetric.TOP1_PER_POSITION and labels.size and int(labels.min()) < 0:
        return f"a label is {int(labels.min())}: only top1_per_position ignores negative labels (padding)"
    if spec.metric is EvaluationMetric.TOPK and spec.k > classes:
        return f"evaluation.k is {spec.k}, the output has {classes} classes"
    return None


def _map_problem(output: np.ndarray, labels: np.ndarray, spec: EvaluationSpec) -> str | None:
    per_output = int(np.prod(output.shape[1:], dtype=np.int64)) if output.ndim else 1
    per_label = int(np.prod(labels.shape[1:], dtype=np.int64)) if labels.ndim else 1
    if labels.ndim == 0 or output.ndim == 0 or labels.shape[0] != output.shape[0] or per_label != per_output:
        return (
            f"labels are {_shape(labels)}, the output is {_shape(output)}: {spec.metric.value} needs one label per "
            "output value (the same shape, or the same number of values per sample)"
        )
    if spec.metric is EvaluationMetric.IOU:
        if labels.dtype.kind not in "biuf" or (labels.size and not np.isin(np.unique(labels), (0, 1)).all()):
            return "iou labels are masks: 0 (background) and 1 (foreground), or booleans"
    elif labels.dtype.kind not in "biuf" or not np.isfinite(labels.astype(np.float64)).all():
        return f"{spec.metric.value} labels must be finite numbers"
    return None


def check_labels(outputs: Sequence[np.ndarray], labels: Sequence[np.ndarray], spec: EvaluationSpec) -> None:
    """Refuse (INVALID_SPEC, with the shape wanted) labels that cannot be scored against ``outputs`` by the metric."""
    for i, (output, label) in enumerate(zip(outputs, labels, strict=True)):
        output, label = np.asarray(output), np.asarray(label)
        problem = (_class_problem if spec.metric in _CLASSES else _map_problem)(output, label, spec)
        if problem:
            raise InvalidSpec(
                f"evaluation data: {problem} (feed {i})",
                hint=_HINTS[spec.metric],
                errors=[{"field": "evaluation.data", "problem": problem}],
            )


_HINTS = {
    EvaluationMetric.TOP1: "top1 labels: one integer class index per sample, `labels` shaped [N].",
    EvaluationMetric.TOPK: "topk labels: one integer class index per sample, `labels` shaped [N]; set evaluation.k.",
    EvaluationMetric.TOP1_PER_POSITION: "top1_per_position labels: an integer class index per position, shaped like "
    "the output without its class axis ([N, T] for [N, T, V] logits); -1 marks padding.",
    EvaluationMetric.MSE: "mse labels: the expected output, shaped like it.",
    EvaluationMetric.MAE: "mae labels: the expected output, shaped like it.",
    EvaluationMetric.IOU: "iou labels: a 0/1 mask per sample with as many values as the output map "
    "(e.g. [N, H, W] for an [N, 1, H, W] map).",
}


def _classes(output: np.ndarray, labels: np.ndarray, spec: EvaluationSpec) -> tuple[float, int]:
    """Return (labels right, labels counted) of one feed."""
    scores = _class_scores(output, spec.class_axis)
    labels = np.asarray(labels).astype(np.int64)
    valid = labels >= 0
    index = np.where(valid, labels, 0)[..., None]
    if spec.metric is EvaluationMetric.TOPK:
        # Right when fewer than k classes score strictly higher than the label's: ties count for it.
        higher = (scores > np.take_along_axis(scores, index, axis=-1)).sum(axis=-1)
        right = higher < spec.k
    else:
        right = scores.argmax(axis=-1) == labels
    return float((right & valid).sum()), int(valid.sum())


def _errors(output: np.ndarray, labels: np.ndarray, spec: EvaluationSpec) -> tuple[float, int]:
    """Return (summed error, elements) of one feed."""
    diff = np.asarray(output, np.float64).reshape(-1) - np.asarray(labels, np.float64).reshape(-1)
    total = float(np.square(diff).sum() if spec.metric is EvaluationMetric.MSE else np.abs(diff).sum())
    return total, int(diff.size)


def _ious(output: np.ndarray, labels: np.ndarray, spec: EvaluationSpec) -> list[float]:
    """Return each sample's IoU of the thresholded output with its mask (1.0 where both are empty)."""
    n = output.shape[0]
    predicted = np.asarray(output).reshape(n, -1) > spec.threshold
    truth = np.asarray(labels).reshape(n, -1) != 0
    inter = (predicted & truth).sum(axis=1)
    union = (predicted | truth).sum(axis=1)
    return [float(i / u) if u else 1.0 for i, u in zip(inter, union, strict=True)]


def score(outputs: Sequence[np.ndarray], labels: Sequence[np.ndarray], spec: EvaluationSpec) -> Score:
    """Return the metric of ``spec`` over every feed's output and labels (checked first with :func:`check_labels`)."""
    per_feed: list[float] = []
    nonfinite = 0
    if spec.metric is EvaluationMetric.IOU:
        ious: list[float] = []
        for output, label in zip(outputs, labels, strict=True):
            nonfinite += int(not np.isfinite(np.asarray(output, np.float64)).all())
            mine = _ious(np.asarray(output), np.asarray(label), spec)
            ious.extend(mine)
            per_feed.append(float(np.mean(mine)) if mine else 1.0)
        return Score(float(np.mean(ious)) if ious else float("nan"), len(ious), per_feed, nonfinite)
    total, counted = 0.0, 0
    for output, label in zip(outputs, labels, strict=True):
        output = np.asarray(output)
        if output.dtype.kind in "fc":
            nonfinite += int(not np.isfinite(output).all())
        value, n = (_classes if spec.metric in _CLASSES else _errors)(output, np.asarray(label), spec)
        total, counted = total + value, counted + n
        per_feed.append(value / n if n else (1.0 if spec.metric in _CLASSES else 0.0))
    return Score(total / counted if counted else float("nan"), counted, per_feed, nonfinite)
