"""A published version scored again on labelled data: `kiln verify --evaluation eval.npz`.

The artifact is opened on its own engine (the runner its export was checked with, with the
options the manifest records), run on the file's labelled samples, and scored with the metric
the version was published with (the manifest's ``spec.evaluation``), by the same code the
export step scores with (services/validation/evaluation.py, task_metrics.py). The drop is
measured against the source's score recorded in the manifest at publish, which the signature
covers; on the job's own evaluation data the artifact's score should also be the one recorded.
"""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from services.errors import InvalidSpec
from services.formats import Format
from services.repository.publish import MANIFEST
from services.tensors import TensorSpec

__all__ = ["evaluate_version"]

#: The file a runner opens, by format, for versions whose manifest does not name it (before ``entry``).
_ENTRIES = {
    "onnx": "model.onnx",
    "openvino_ir": "model.xml",
    "tflite": "model.tflite",
    "mnn": "model.mnn",
    "ncnn": "model.ncnn.param",
    "tensorrt_plan": "model.plan",
    "savedmodel": "",
}


def _spelling(name: str) -> str:
    return re.sub(r"[^0-9a-z]", "", name.lower())


def _runner_options(fmt: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """Return the options the export opened its artifact with, as far as the manifest records them."""
    details = manifest.get("engine_details") or {}
    if fmt == "openvino_ir":
        return {"inference_precision": "f32"}  # what parity was checked at (services/exporters/openvino.py)
    if fmt == "tflite":
        signature = (details.get("tflite") or {}).get("signature")
        return {"signature": signature} if signature else {}
    if fmt == "mnn":
        precision = (details.get("runtime") or {}).get("precision")
        specs = [TensorSpec.from_dict(t) for t in (manifest.get("io") or {}).get("inputs", [])]
        return {**({"precision": precision} if precision else {}), **({"tensor_specs": specs} if specs else {})}
    return {}


def _evaluation_inputs(runner_inputs: list[TensorSpec], data_path: Path) -> list[TensorSpec]:
    """Return the artifact's inputs named as the evaluation file names them (converters respell names)."""
    try:
        with np.load(data_path, allow_pickle=False) as npz:
            keys = {k.partition("/")[2] or k for k in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile):
        return runner_inputs  # load_evaluation says what is wrong with the file
    out = []
    for t in runner_inputs:
        same = [k for k in keys if _spelling(k) == _spelling(t.name)]
        name = t.name if t.name in keys or len(same) != 1 else same[0]
        out.append(TensorSpec(name=name, dtype=t.dtype, shape=t.shape))
    return out


def evaluate_version(version_dir: Path, data_path: Path) -> dict[str, Any]:
    """Return the evaluation report of the version's artifact on ``data_path`` against the source's recorded score.

    INVALID_SPEC when the version was published without an evaluation (nothing says which metric,
    nor what the source scored); ACCURACY_DROP_EXCEEDED, both scores in its details, when the
    artifact loses more than the version's ``max_drop``.
    """
    from services.exporters._common import adapt_feed
    from services.runners import open_runner
    from services.spec import CompileSpec
    from services.validation.evaluation import artifact_output, check_drop, evaluation_report, load_evaluation
    from services.validation.task_metrics import Score, check_labels, score

    manifest = json.loads((version_dir / MANIFEST).read_text())
    recorded = manifest.get("evaluation") or {}
    spec = CompileSpec.model_validate(manifest.get("spec") or {})
    evaluation = spec.evaluation
    if evaluation is None or recorded.get("source") is None:
        raise InvalidSpec(
            f"{version_dir.name} was published without an evaluation: its manifest names no metric and no source score",
            hint="Compile with --evaluation (the spec's evaluation) to publish a version that can be scored again.",
        )
    fmt = str(manifest.get("format"))
    entry = manifest.get("entry", _ENTRIES.get(fmt, ""))
    runner = open_runner(Format(fmt), version_dir / entry if entry else version_dir, **_runner_options(fmt, manifest))
    try:
        data = load_evaluation(data_path, _evaluation_inputs(list(runner.inputs), data_path), spec)
        name = artifact_output(recorded["output"], [recorded["output"]], [t.name for t in runner.outputs])
        outputs = [np.asarray(runner.run(adapt_feed(feed, runner))[name]) for feed in data.feeds]
    finally:
        runner.close()
    check_labels(outputs, data.labels, evaluation)
    source = Score(float(recorded["source"]), int(recorded.get("counted") or 0))
    report = evaluation_report(
        evaluation, recorded["output"], data.samples, source, score(outputs, data.labels, evaluation)
    )
    report["recorded"] = {k: recorded.get(k) for k in ("artifact", "source", "drop", "samples")}
    report["engine"] = manifest.get("target")
    check_drop(report, manifest.get("target"), str(manifest.get("precision")))
    return report
