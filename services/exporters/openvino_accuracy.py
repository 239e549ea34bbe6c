"""OpenVINO int8 within the spec's accuracy bound: NNCF's ``quantize_with_accuracy_control`` on the labelled data.

With ``evaluation`` in the spec, the openvino target's int8 is searched, not taken as it comes:

1. NNCF quantises the IR as it would without labels (services/exporters/openvino.py's arguments)
   and Kiln scores that plain int8 model on the labelled data. Within ``max_drop`` it is the
   artifact, and nothing more is done.
2. Otherwise ``nncf.quantize_with_accuracy_control`` quantises again and reverts the groups of
   quantised operations that cost most accuracy to float, one at a time, scoring each step with
   the spec's metric, until the drop is within ``max_drop`` (or nothing is left to revert).

The validation function is the evaluation's own metric (services/validation/task_metrics.py) on
the labelled feeds, each item's own value returned too so that NNCF ranks quantisers by them; a
lower-is-better metric (mse, mae) is negated for NNCF, whose metrics grow with accuracy, so its
absolute drop is the rise Kiln bounds. The export's parity gate follows the search, and an
artifact within max_drop that the gate refuses is no answer: so a candidate that misses the
parity bounds against the fp32 IR on the calibration samples (up to ACCURACY_CHECK_SAMPLES, the
SNR bound raised as onnxruntime's search raises it) scores max_drop lower, and more for a larger shortfall; NNCF
then goes on reverting, and ranks first the groups whose reverting restores parity. NNCF compiles every candidate with f32 inference, as
Kiln's parity does. What stayed in float is read off the two models: the operations that read a
FakeQuantize in the plain int8 model and no longer do. The drop reached is Kiln's own score of
the result, and the export then checks it again, with parity, on the artifact as saved.

The search picks its artifact on the labelled data it is judged on: the manifest says so
(``selected_on_evaluation_data``); a held-out set is the user's to keep.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from services.errors import ConversionFailed, KilnError
from services.exporters.openvino import (
    PARITY_INFERENCE_PRECISION,
    model_items,
    quantization_arguments,
    quiet_nncf,
)
from services.exporters.ort_int8 import ACCURACY_CHECK_SAMPLES, CHECK_MARGIN_DB
from services.spec import EvaluationSpec, Tolerances
from services.steps.reference import ReferenceData

__all__ = ["int8_operations", "quantize_within_max_drop"]

#: NNCF's score of a candidate that gave no number: below any real one, so it is never kept.
_NOT_A_SCORE = -1e30


def int8_operations(model: Any) -> set[str]:
    """Return the friendly names of the operations of ``model`` that read a FakeQuantize (run in int8)."""
    found = set()
    for op in model.get_ops():
        if op.get_type_name() != "FakeQuantize":
            continue
        for target in op.output(0).get_target_inputs():
            node = target.get_node()
            if node.get_type_name() != "FakeQuantize":
                found.add(str(node.get_friendly_name()))
    return found


def _output_index(model: Any, ref: ReferenceData, output: str) -> int:
    from services.runners.openvino import ov_tensor_spec
    from services.validation.evaluation import artifact_output

    names = [ov_tensor_spec(p, f"output_{i}").name for i, p in enumerate(model.outputs)]
    return names.index(artifact_output(output, ref.output_names, names))


def _compiled(model: Any) -> Any:
    import openvino as ov

    return ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": PARITY_INFERENCE_PRECISION})


def quantize_within_max_drop(
    model: Any,
    feeds: list[dict[str, np.ndarray]],
    ref: ReferenceData,
    evaluation: EvaluationSpec,
    scorer: Callable[[list[np.ndarray]], dict[str, Any]],
    tol: Tolerances,
    progress: Callable[[str], None] = lambda _m: None,
) -> tuple[Any, dict[str, Any]]:
    """Return ``model`` quantised to int8 within ``evaluation.max_drop`` on the labelled data (when NNCF can), and
    the settings with ``accuracy_control``: the plain int8 score, whether the search ran, what stayed in float and
    the score reached."""
    import nncf
    from nncf.quantization.advanced_parameters import AdvancedAccuracyRestorerParameters

    from services.validation.task_metrics import score

    data = ref.evaluation
    assert data is not None
    items, arguments, settings = quantization_arguments(model, feeds)
    index = _output_index(model, ref, data.output)
    labelled = model_items(model, data.feeds)
    sign = 1.0 if evaluation.metric.higher_is_better else -1.0
    parity = _parity_check(model, feeds[:ACCURACY_CHECK_SAMPLES], tol)

    def outputs_of(compiled: Any, which: Iterable[int]) -> list[np.ndarray]:
        return [np.asarray(compiled(labelled[i])[index]) for i in which]

    def validate(compiled: Any, chosen: Iterable[int]) -> tuple[float, list[float]]:
        which = list(chosen)
        got = score(outputs_of(compiled, which), [data.labels[i] for i in which], evaluation)
        if not got.finite:
            return _NOT_A_SCORE, [_NOT_A_SCORE] * len(which)
        per_item = [sign * v if math.isfinite(v) else _NOT_A_SCORE for v in got.per_feed]
        return sign * got.value - parity.penalty(compiled, evaluation.max_drop), per_item

    def report_of(quantized: Any) -> dict[str, Any]:
        return scorer(outputs_of(_compiled(quantized), range(len(labelled))))

    with quiet_nncf():
        plain = nncf.quantize(model, nncf.Dataset(items), **arguments)
    plain_report = report_of(plain)
    plain_parity = parity.verdict(_compiled(plain))
    control: dict[str, Any] = {
        "tool": "nncf.quantize_with_accuracy_control",
        "metric": evaluation.metric.value,
        "max_drop": evaluation.max_drop,
        "samples": data.samples,
        "plain_int8": {**_verdict(plain_report), **plain_parity},
        "parity_checked_on": f"{parity.samples} calibration samples against the fp32 IR, SNR bound raised "
        f"{CHECK_MARGIN_DB} dB",
        "selected_on_evaluation_data": True,
    }
    settings["accuracy_control"] = control
    if plain_report.get("passed") and plain_parity["parity_passed"]:
        control.update(needed=False, reached=control["plain_int8"], left_in_float=[])
        return plain, settings
    progress(
        f"plain int8 {evaluation.metric.value} drop {plain_report.get('drop')} > max_drop {evaluation.max_drop}: "
        "NNCF accuracy control reverts the costliest int8 operations to float"
    )
    advanced = dict(arguments)
    try:
        with quiet_nncf():
            controlled = nncf.quantize_with_accuracy_control(
                model,
                nncf.Dataset(items),
                # Items are indices into the labelled feeds: the validation function reads feeds and labels by them.
                nncf.Dataset(list(range(len(labelled)))),
                validate,
                max_drop=evaluation.max_drop,
                drop_type=nncf.DropType.ABSOLUTE,
                preset=advanced.pop("preset"),
                model_type=advanced.pop("model_type"),
                subset_size=advanced.pop("subset_size"),
                target_device=advanced.pop("target_device"),
                advanced_quantization_parameters=advanced.pop("advanced_parameters"),
                advanced_accuracy_restorer_parameters=AdvancedAccuracyRestorerParameters(),
            )
    except KilnError:
        raise
    except Exception as exc:  # NNCF's own failures: the user needs its words, not a traceback
        raise ConversionFailed(
            f"NNCF accuracy control failed: {type(exc).__name__}: {str(exc)[:300]}",
            hint="Compile at fp16 or fp32, or without `evaluation` for plain int8.",
            tool="nncf.quantize_with_accuracy_control",
        ) from exc
    reached = report_of(controlled)
    reverted = sorted(int8_operations(plain) - int8_operations(controlled))
    control.update(
        needed=True,
        reached={**_verdict(reached), **parity.verdict(_compiled(controlled))},
        left_in_float=reverted,
        int8_operations={"plain": len(int8_operations(plain)), "kept": len(int8_operations(controlled))},
    )
    progress(
        f"accuracy control left {len(reverted)} operation(s) in float: {evaluation.metric.value} drop "
        f"{reached.get('drop')} (max_drop {evaluation.max_drop})"
    )
    return controlled, settings


class _ParityCheck:
    """The parity bounds against the fp32 IR on a few calibration samples, as a penalty on NNCF's metric."""

    def __init__(self, model: Any, feeds: list[dict[str, np.ndarray]], tol: Tolerances) -> None:
        from services.runners.openvino import ov_tensor_spec

        self.items = model_items(model, feeds)
        self.names = [ov_tensor_spec(p, f"output_{i}").name for i, p in enumerate(model.outputs)]
        self.samples = len(self.items)
        self.expected = self._run(_compiled(model))
        self.tol = tol

    def _run(self, compiled: Any) -> list[dict[str, np.ndarray]]:
        return [
            {name: np.asarray(out[i]) for i, name in enumerate(self.names)}
            for out in (compiled(item) for item in self.items)
        ]

    def verdict(self, compiled: Any) -> dict[str, Any]:
        from services.validation import check_parity

        report = check_parity(
            self._run(compiled), self.expected, self.tol, inputs_from="calibration", raise_on_failure=False
        )
        snrs = [o.snr_db for o in report.outputs if o.snr_db is not None]
        worst = min(snrs) if snrs else None
        return {
            "parity_passed": report.passed,
            "worst_snr_db": round(worst, 2) if worst is not None and math.isfinite(worst) else None,
        }

    def penalty(self, compiled: Any, max_drop: float) -> float:
        """Return 0 when ``compiled`` keeps the parity bounds, else more than max_drop, growing with the shortfall."""
        said = self.verdict(compiled)
        if said["parity_passed"]:
            return 0.0
        bound = self.tol.min_snr_db if self.tol.min_snr_db is not None else 0.0
        short = bound - said["worst_snr_db"] if said["worst_snr_db"] is not None else 100.0
        return max_drop + 1e-6 + 0.01 * max(short, 0.0)


def _parity_check(model: Any, feeds: list[dict[str, np.ndarray]], tol: Tolerances) -> _ParityCheck:
    """Return the check on ``feeds`` with the SNR bound raised by the margin the onnxruntime search uses."""
    if tol.min_snr_db is not None:
        # In-sample samples flatter int8 (the ranges were set on them): the bound is raised, as onnxruntime's.
        tol = tol.model_copy(update={"min_snr_db": tol.min_snr_db + CHECK_MARGIN_DB})
    return _ParityCheck(model, feeds, tol)


def _verdict(report: dict[str, Any]) -> dict[str, Any]:
    return {"score": report.get("artifact"), "drop": report.get("drop"), "within_max_drop": bool(report.get("passed"))}
