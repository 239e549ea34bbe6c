"""Evaluation on labelled data: the spec's ``evaluation`` file read, batched, and the drop judged.

The file (``evaluation.data``) is an .npz in one of the two layouts a calibration file has,
plus the labels; nothing in it is unpickled:

- keyed by input name, samples stacked on axis 0, and ``labels`` with the same number of
  samples on its axis 0 (the default layout);
- whole feeds keyed ``<sample>/<input>``, each sample's labels as ``<sample>/labels`` (inputs
  of other shapes per sample: text lines of other widths, scalars).

What a label is depends on the metric (services/validation/task_metrics.py checks it against
the output). The reference step scores the source on the file; each export scores its
artifact on the same feeds and fails the target (ACCURACY_DROP_EXCEEDED, both scores in the
details) when it loses more than ``evaluation.max_drop``.
"""

from __future__ import annotations

import math
import re
import zipfile
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from services.errors import AccuracyDropExceeded, InvalidSpec
from services.spec import MAX_INPUT_BYTES, CompileSpec, EvaluationSpec, format_bytes
from services.tensors import TensorSpec
from services.validation.inputs import FEED_KEY_SEPARATOR, resolve_shape
from services.validation.task_metrics import Score

__all__ = [
    "LABELS_KEY",
    "EvaluationData",
    "artifact_output",
    "check_drop",
    "evaluation_report",
    "inspect_evaluation_file",
    "load_evaluation",
    "scored_output",
]

#: The key of the labels in the default layout, and of each sample's labels in the whole-feed one.
LABELS_KEY = "labels"
_LAYOUT_HINT = (
    "Write it with numpy.savez(path, <input name>=inputs, labels=labels), samples on axis 0 of each, or as whole "
    "feeds: numpy.savez(path, **{'0/<input name>': x0, '0/labels': y0, '1/<input name>': x1, ...})."
)


@dataclass
class EvaluationData:
    """The labelled samples, batched as the model takes them: one labels array per feed."""

    feeds: list[dict[str, np.ndarray]]
    labels: list[np.ndarray]
    samples: int
    layout: str  # "by input name" | "whole feeds"


def _refuse(problem: str, hint: str = _LAYOUT_HINT) -> InvalidSpec:
    return InvalidSpec(
        f"evaluation data: {problem}", hint=hint, errors=[{"field": "evaluation.data", "problem": problem}]
    )


def _read(path: str | Path) -> dict[str, np.ndarray]:
    name = Path(path).name
    try:
        if not zipfile.is_zipfile(path):  # np.load would take anything else for a pickle
            raise _refuse(f"{name} is not a readable .npz (not the zip archive numpy.savez writes)")
        with np.load(Path(path), allow_pickle=False) as npz:
            return {k: npz[k] for k in npz.files}
    except ValueError as exc:  # numpy's refusal of an object array without allow_pickle
        raise _refuse(
            f"{name} holds object arrays, which only unpickling could read: Kiln never unpickles",
            hint="Store inputs and labels as numeric (or fixed-width string) arrays. " + _LAYOUT_HINT,
        ) from exc
    except (OSError, zipfile.BadZipFile, EOFError) as exc:
        raise _refuse(f"{name} is not a readable .npz ({exc})") from exc


def _whole_feed(data: dict[str, np.ndarray], names: Collection[str]) -> bool:
    return bool(data) and all(FEED_KEY_SEPARATOR in k for k in data) and not set(names) & set(data)


def _samples(data: dict[str, np.ndarray], names: Collection[str] | None) -> tuple[int, str]:
    """Return the number of labelled samples and the layout; refuse a file that cannot be one."""
    if not data:
        raise _refuse("the file holds no arrays")
    if _whole_feed(data, names or ()):
        groups: dict[str, set[str]] = {}
        for key in data:
            sample, _, name = key.partition(FEED_KEY_SEPARATOR)
            groups.setdefault(sample, set()).add(name)
        unlabelled = sorted(s for s, keys in groups.items() if LABELS_KEY not in keys)
        if unlabelled:
            raise _refuse(f"samples {unlabelled[:5]} have no '<sample>/{LABELS_KEY}' array")
        if names is not None:
            for sample, keys in groups.items():
                if keys - {LABELS_KEY} != set(names):
                    raise _refuse(
                        f"sample {sample!r} holds inputs {sorted(keys - {LABELS_KEY})}, the model takes {sorted(names)}"
                    )
        return len(groups), "whole feeds"
    if LABELS_KEY not in data:
        raise _refuse(f"no `{LABELS_KEY}` array among {sorted(data)[:10]}")
    inputs = {k: v for k, v in data.items() if k != LABELS_KEY}
    if names is not None and set(inputs) != set(names):
        raise _refuse(f"the inputs are keyed {sorted(inputs)}, the model takes {sorted(names)}")
    counts = {k: int(v.shape[0]) if v.ndim else 0 for k, v in data.items()}
    if len(set(counts.values())) != 1 or 0 in counts.values():
        raise _refuse(f"the arrays need the same non-zero number of samples on axis 0, got {counts}")
    return counts[LABELS_KEY], "by input name"


def inspect_evaluation_file(path: str | Path, input_names: Collection[str] | None = None) -> int:
    """Return how many labelled samples the file holds; INVALID_SPEC (with the layout) when it cannot be read as one.

    Without ``input_names`` only the file's own consistency is checked (the API does this at
    submission, before it knows the model's inputs).
    """
    _refuse_labels_input(input_names or ())
    return _samples(_read(path), input_names)[0]


def _refuse_labels_input(names: Collection[str]) -> None:
    if LABELS_KEY in names:
        raise _refuse(
            f"the model has an input named `{LABELS_KEY}`, the key the labels take",
            hint="Rename the model's input, or compile without evaluation.",
        )


def _as_input(arr: np.ndarray, t: TensorSpec) -> np.ndarray:
    if t.dtype in ("str", "bfloat16") or arr.dtype.kind in "US":
        return arr
    return arr.astype(np.dtype(t.dtype), copy=False)


def load_evaluation(path: str | Path, inputs: list[TensorSpec], spec: CompileSpec) -> EvaluationData:
    """Return the file's labelled samples as feeds of the model's batch size (one sample when the batch is open)."""
    names = [t.name for t in inputs]
    _refuse_labels_input(names)
    data = _read(path)
    count, layout = _samples(data, names)
    nbytes = sum(int(v.nbytes) for v in data.values())
    if nbytes > MAX_INPUT_BYTES:
        raise _refuse(
            f"the file holds {format_bytes(nbytes)} of arrays; the limit is {format_bytes(MAX_INPUT_BYTES)}",
            hint="Score on fewer samples: a few hundred to a few thousand say as much.",
        )
    if layout == "whole feeds":
        by_sample: dict[str, dict[str, np.ndarray]] = {}
        for key, arr in data.items():
            sample, _, name = key.partition(FEED_KEY_SEPARATOR)
            by_sample.setdefault(sample, {})[name] = arr
        order = sorted(by_sample, key=lambda k: (not k.isdigit(), int(k) if k.isdigit() else 0, k))
        feeds = [{t.name: _as_input(by_sample[s][t.name], t) for t in inputs} for s in order]
        labels = [np.asarray(by_sample[s][LABELS_KEY]) for s in order]
        return EvaluationData(feeds, labels, count, layout)
    shapes = {t.name: resolve_shape(t, spec) for t in inputs}
    batch = max(1, min((shapes[t.name][0] for t in inputs if shapes[t.name]), default=1))
    if count % batch:
        raise _refuse(
            f"{count} samples do not fill batches of {batch}, the model's fixed batch size",
            hint=f"Give a multiple of {batch} samples.",
        )
    feeds, labels = [], []
    for start in range(0, count, batch):
        feed = {}
        for t in inputs:
            arr = data[t.name][start : start + batch]
            want = shapes[t.name]
            if arr.ndim == len(want) - 1:  # samples stored without their batch axis
                arr = arr[None, ...]
            fixed = list(t.shape[1:])
            if len(arr.shape) != len(want) or any(
                d is not None and d != a for d, a in zip(fixed, arr.shape[1:], strict=False)
            ):
                raise _refuse(
                    f"input {t.name} has sample shape {list(arr.shape[1:])}, the model takes "
                    f"{[d if d is not None else -1 for d in fixed]} (-1: any)"
                )
            feed[t.name] = _as_input(arr, t)
        feeds.append(feed)
        labels.append(np.asarray(data[LABELS_KEY][start : start + batch]))
    return EvaluationData(feeds, labels, count, layout)


def scored_output(evaluation: EvaluationSpec, outputs: Sequence[str]) -> str:
    """Return the output ``evaluation`` scores: the one it names, else the model's only output."""
    if evaluation.output is not None:
        if evaluation.output not in outputs:
            raise InvalidSpec(
                f"evaluation.output {evaluation.output!r} is not an output of the model",
                hint=f"The model's outputs: {list(outputs)}.",
                errors=[{"field": "evaluation.output", "problem": "the model has no such output"}],
            )
        return evaluation.output
    if len(outputs) != 1:
        raise InvalidSpec(
            f"the model has {len(outputs)} outputs: evaluation.output must name the one to score",
            hint=f"The model's outputs: {list(outputs)}.",
            errors=[{"field": "evaluation.output", "problem": "required for a model with several outputs"}],
        )
    return outputs[0]


def _spelling(name: str) -> str:
    return re.sub(r"[^0-9a-z]", "", name.lower())


def artifact_output(name: str, source_outputs: Sequence[str], artifact_outputs: Sequence[str]) -> str:
    """Return the artifact's name for the source's output ``name``: the same, the same spelling, else by position.

    Converters respell names (onnx2tf's underscores for dots) and a SavedModel lists its
    outputs in its own order; parity pairs them the same way.
    """
    if name in artifact_outputs:
        return name
    spelled = [a for a in artifact_outputs if _spelling(a) == _spelling(name)]
    if len(spelled) == 1:
        return spelled[0]
    if len(source_outputs) == len(artifact_outputs) and name in source_outputs:
        return artifact_outputs[list(source_outputs).index(name)]
    raise InvalidSpec(
        f"the artifact has no output matching {name!r} (its outputs: {list(artifact_outputs)})",
        hint="Set evaluation.output to the source model's name of the output to score.",
    )


def _finite(x: float) -> float | None:
    """Return ``x`` to 7 significant digits (an MSE of 1e-7 keeps its digits), None when it is not a number."""
    return float(f"{x:.7g}") if math.isfinite(x) else None


def evaluation_report(
    evaluation: EvaluationSpec, output: str, samples: int, source: Score, artifact: Score | None = None
) -> dict[str, Any]:
    """Return what the manifest, the job and the page say: metric, both scores, the drop and the verdict."""
    report: dict[str, Any] = {
        "metric": evaluation.metric.value,
        "output": output,
        "samples": samples,
        "counted": source.counted,
        "higher_is_better": evaluation.metric.higher_is_better,
        "source": _finite(source.value),
        "max_drop": evaluation.max_drop,
    }
    if evaluation.metric.value == "topk":
        report["k"] = evaluation.k
    if evaluation.metric.value == "iou":
        report["threshold"] = evaluation.threshold
    if artifact is None:
        return report
    drop = None
    if artifact.finite and source.finite:
        drop = source.value - artifact.value if evaluation.metric.higher_is_better else artifact.value - source.value
    report.update(
        artifact=_finite(artifact.value),
        drop=None if drop is None else _finite(drop),
        # A drop equal to the bound holds (NNCF's accuracy control stops at drop <= max_drop too).
        passed=drop is not None and drop <= evaluation.max_drop,
    )
    if artifact.nonfinite:
        report["nonfinite_feeds"] = artifact.nonfinite
    return report


def check_drop(report: dict[str, Any], target: str | None, precision: str, **details: Any) -> None:
    """Raise ACCURACY_DROP_EXCEEDED, both scores in its details (and ``details``), when the drop is past max_drop."""
    if report.get("passed", True):
        return
    metric = report["metric"]
    if report.get("drop") is None:
        said = f"the artifact's {metric} is not a number ({report.get('nonfinite_feeds', 0)} feeds gave NaN or inf)"
    else:
        said = (
            f"{metric} {report['artifact']:.4f} against the source's {report['source']:.4f} on "
            f"{report['samples']} labelled samples: a drop of {report['drop']:.4f}, past max_drop {report['max_drop']}"
        )
    raise AccuracyDropExceeded(
        f"{target} {precision} artifact loses accuracy: {said}",
        evaluation=report,
        target=target,
        **{k: v for k, v in details.items() if v is not None},
    )
