"""The reference step: the source model, run by its own framework, on the parity inputs.

The steps after it read its artifact through services/steps/reference.py.

Its artifact holds the signature, the inputs every target is checked on and the source's
outputs for them, and a separate set of int8 calibration samples. Parity is measured on
samples the quantiser never saw: checking an int8 artifact on its own calibration rows
flatters it (measured: 5-10x lower error than on held-out rows for a transformer block).
With a calibration file every fourth row is held out for parity; with generated samples the
calibration set is drawn with a different seed. Parity rests on at least
``validation.min_unseen_samples`` samples the quantiser never saw: when the file holds out
fewer, the rest are made from its rows (services/validation/inputs.py ``synthesize_feeds``),
and the manifest says how many of each.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from services.artifacts import Artifact
from services.errors import InvalidSpec, SourceNonfinite
from services.formats import Format
from services.runners import ModelRunner, TensorSpec, open_runner
from services.steps.context import StepContext
from services.steps.reference import EVALUATION_INPUTS, EVALUATION_LABELS
from services.validation import load_calibration, make_validation_inputs
from services.validation.inputs import (
    ParityInputs,
    add_other_shapes,
    calibration_parity_inputs,
    check_spec_inputs,
    make_parity_inputs,
    synthesize_feeds,
)

__all__ = ["refuse_nonfinite", "run_reference_step", "source_runner"]


def source_runner(ctx: StepContext) -> ModelRunner:
    """Open the job's source model with its own framework (given its format's spec options, if it has any).

    An ONNX source runs in the first runtime that can run it (services/runners/onnx_source.py).
    """
    if ctx.source.format is Format.ONNX:
        from services.runners.onnx_source import OnnxSourceRunner

        return OnnxSourceRunner(ctx.source.path, options=ctx.spec.options_for(ctx.source.format.value))
    return open_runner(
        ctx.source.format,
        ctx.source.path,
        signature=ctx.spec.signature,
        inputs=ctx.spec.inputs,
        options=ctx.spec.options_for(ctx.source.format.value),
    )


def _pack(samples: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {f"{i}/{name}": _storable(arr) for i, feed in enumerate(samples) for name, arr in feed.items()}


def _storable(arr: np.ndarray) -> np.ndarray:
    """Return ``arr`` as an .npz can hold it without pickling: string tensors (object arrays) as unicode."""
    arr = np.asarray(arr)
    if arr.dtype == object and all(isinstance(x, str | bytes) for x in arr.flat):
        return np.array([x.decode() if isinstance(x, bytes) else x for x in arr.flat], dtype=str).reshape(arr.shape)
    return arr


def _save(path: Path, arrays: dict[str, np.ndarray]) -> None:
    # numpy's stub types savez's **kwds against its own `allow_pickle: bool` keyword, so a
    # dict of arrays does not type-check; the call itself is what numpy documents.
    savez: Any = np.savez
    savez(path, **arrays)


#: Every HOLD_OUT-th calibration row is kept for parity, never shown to the quantiser.
HOLD_OUT = 4


def _held_out_note(held: int, rows: int, wanted: int, made: int) -> str:
    """Return what the job page and manifest say when few rows are held out, and what Kiln made up for it.

    Calibration rows alone are not added to the check: they flatter an int8 artifact (measured on a real
    int8 text encoder from an 8-row file: cosine 0.947 on its 2 held-out rows and on the 6 calibration
    rows alike, 0.917 on 8 held-out rows of a 32-row file, 0.80 on other real inputs), so they would
    add numbers without adding evidence. Mixtures and perturbations of the rows are new inputs.
    """
    if held >= wanted:
        return ""
    return (
        f"only {held} of the file's {rows} rows are held out from calibration; {made} more check inputs were made "
        f"from the rows to reach validation.min_unseen_samples ({wanted}): give {wanted * HOLD_OUT} rows or more "
        "for a verdict on real data alone"
    )


def _split_samples(
    runner: ModelRunner,
    ctx: StepContext,
    calibration: dict[str, np.ndarray] | list[dict[str, np.ndarray]] | None,
) -> tuple[ParityInputs, list[dict[str, np.ndarray]], str]:
    """Return (parity inputs, calibration feeds, where calibration came from)."""
    bounds = runner.input_bounds()
    if calibration is not None:
        if isinstance(calibration, list):  # whole feeds, one per sample: taken as they are
            rows = [{t.name: _as_dtype(feed[t.name], t) for t in runner.inputs} for feed in calibration]
        else:
            rows, _ = make_validation_inputs(runner.inputs, ctx.spec, calibration)
        wanted = ctx.spec.validation.min_unseen_samples
        if len(rows) >= HOLD_OUT:
            held = [r for i, r in enumerate(rows) if i % HOLD_OUT == HOLD_OUT - 1]
            calib = [r for i, r in enumerate(rows) if i % HOLD_OUT != HOLD_OUT - 1]
            label, unseen = "calibration file", len(held)
        else:
            held, calib, label = rows, rows, "calibration file (too few rows to hold any out for parity)"
            unseen = 0  # every row is also a calibration row
        made, how = synthesize_feeds(rows, max(0, wanted - unseen), np.random.default_rng(ctx.spec.validation.seed + 3))
        few_held = _held_out_note(unseen, len(rows), wanted, len(made))
        parity = calibration_parity_inputs(held + made, runner.inputs, ctx.spec)
        parity.evidence = {"unseen": unseen + len(made), "real": unseen, "synthesized": len(made), "rows": len(rows)}
        if isinstance(calibration, list):  # the user's feeds are the shapes to check
            parity.provenance = {t.name: "whole feeds of the calibration file" for t in runner.inputs}
            parity.shapes = (
                [{name: list(np.shape(value)) for name, value in held[0].items()}] if held else parity.shapes
            )
        else:
            add_other_shapes(parity, runner.inputs, ctx.spec, bounds)
        if few_held:
            parity.provenance["held out"] = few_held
        if made:
            parity.provenance["synthesized"] = how
        return parity, calib, label
    count = max(ctx.spec.validation.samples, ctx.spec.validation.min_unseen_samples)
    parity = make_parity_inputs(runner.inputs, ctx.spec, bounds, samples=count)
    parity.evidence = {"unseen": count, "real": 0, "generated": count}
    seed = ctx.spec.validation.seed + 1
    calib = make_parity_inputs(
        runner.inputs, ctx.spec, bounds, seed=seed, samples=max(16, ctx.spec.validation.samples), extra_shapes=False
    ).feeds
    return parity, calib, f"generated samples, not real data (seed {seed})"


def _as_dtype(arr: np.ndarray, t: TensorSpec) -> np.ndarray:
    if t.dtype in ("str", "bfloat16") or arr.dtype.kind in "US":
        return arr
    return arr.astype(np.dtype(t.dtype), copy=False)


def _run_source(runner: ModelRunner, parity: ParityInputs, ctx: StepContext) -> list[dict[str, np.ndarray]]:
    """Run the source on every parity feed; a shape besides the first that the source refuses is dropped, noted."""
    outputs: dict[int, dict[str, np.ndarray]] = {}
    failed: dict[int, str] = {}
    for i, (feed, group) in enumerate(zip(parity.feeds, parity.shape_of, strict=True)):
        if group in failed:
            continue
        if group == 0:
            outputs[i] = runner.run(feed)
            continue
        try:
            outputs[i] = runner.run(feed)
        except Exception as exc:  # the engine's own error type: this shape is not one the source runs
            failed[group] = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    kept = [outputs[i] for i, g in enumerate(parity.shape_of) if g not in failed]
    for group, why in failed.items():
        parity.provenance[f"shape {group}"] = f"{parity.shapes[group]} not checked: the source does not run it ({why})"
        ctx.progress(f"the source does not run at {parity.shapes[group]}: checking at the first shape only")
        parity.drop_shape(group)
    return kept


def refuse_nonfinite(outputs: list[dict[str, np.ndarray]], inputs_from: str) -> None:
    """Refuse (SOURCE_NONFINITE) a source with an output that is NaN or infinite on every sample.

    Parity compares only values both sides give as numbers: such an output would leave
    nothing to compare, and an artifact of it would pass any bound by comparing nothing.
    """
    dead = []
    for name in outputs[0] if outputs else ():
        values = [np.asarray(o[name]) for o in outputs]
        if not any(np.isfinite(v).any() for v in values if v.size and v.dtype.kind in "fc") and any(
            v.size and v.dtype.kind in "fc" for v in values
        ):
            dead.append(name)
    if dead:
        raise SourceNonfinite(
            f"the source model gives no finite outputs on these inputs: every value of {dead} is NaN or infinite "
            f"on all {len(outputs)} samples ({inputs_from})",
            outputs=dead,
        )


def _score_source(runner: ModelRunner, ctx: StepContext) -> dict[str, Any] | None:
    """Score the source on the spec's labelled data; keep the feeds and labels for the exports; return the meta.

    The labels are checked against the source's own output first, so a file that cannot be
    scored is refused here (INVALID_SPEC), once, not by every target.
    """
    evaluation = ctx.spec.evaluation
    if evaluation is None:
        return None
    from services.validation.evaluation import evaluation_report, load_evaluation, scored_output
    from services.validation.task_metrics import check_labels, score

    path = ctx.extras.get("evaluation_path", evaluation.data)
    data = load_evaluation(path, runner.inputs, ctx.spec)
    name = scored_output(evaluation, [t.name for t in runner.outputs])
    ctx.progress(f"scoring the source on {data.samples} labelled samples ({evaluation.metric.value} of {name})")
    outputs = [np.asarray(runner.run(feed)[name]) for feed in data.feeds]
    check_labels(outputs, data.labels, evaluation)
    result = score(outputs, data.labels, evaluation)
    if not result.finite:
        raise SourceNonfinite(
            f"the source model's {evaluation.metric.value} on the evaluation data is not a number: its output {name} "
            f"holds NaN or infinite values on {result.nonfinite} of {len(data.feeds)} feeds",
            outputs=[name],
        )
    report = evaluation_report(evaluation, name, data.samples, result)
    ctx.progress(f"source {evaluation.metric.value}: {result.value:.4f}")
    _save(ctx.out_dir / EVALUATION_INPUTS, _pack(data.feeds))
    _save(ctx.out_dir / EVALUATION_LABELS, {str(i): labels for i, labels in enumerate(data.labels)})
    return {
        "feeds": len(data.feeds),
        "samples": data.samples,
        "layout": data.layout,
        "output": name,
        "report": report,
        "source_value": result.value,
        "source_per_feed": result.per_feed,
    }


def _noise_floor(
    ctx: StepContext, feeds: list[dict[str, np.ndarray]], outputs: list[dict[str, np.ndarray]], names: list[str]
) -> dict[str, Any] | None:
    """Return how far the source's other kernel set is from the reference on these feeds (None: it has one).

    A source whose runtime has two kernel sets that disagree (LiteRT with and without XNNPACK,
    dynamic quantisation in onnxruntime fused or not) has no single answer an artifact could
    beat; services/validation/noise_floor.py says how the gate uses this.
    """
    from services.validation.noise_floor import alternate_kernels, measure_floor

    options = {"signature": ctx.spec.signature} if ctx.source.format is Format.TFLITE else {}
    try:
        found = alternate_kernels(ctx.source.format, ctx.source.path, options)
    except Exception as exc:  # the engine's own error type: no floor, said in the log
        ctx.progress(f"the source's other kernels could not load it ({type(exc).__name__}): no noise floor")
        return None
    if found is None:
        return None
    runner, kernels = found
    try:
        ctx.progress(f"measuring the source's noise floor: {kernels}")
        alternate = [runner.run(feed) for feed in feeds]
    except Exception as exc:  # the engine's own error type
        ctx.progress(f"{kernels} could not run the source ({type(exc).__name__}): no noise floor")
        return None
    finally:
        runner.close()
    return {"kernels": kernels, "outputs": measure_floor(outputs, alternate, names)}


def run_reference_step(ctx: StepContext) -> Artifact:
    """Compute the signature, parity inputs and source outputs; return the reference artifact."""
    runner = source_runner(ctx)
    check_spec_inputs(runner.inputs, ctx.spec, static=runner.static_arguments)
    unknown = sorted(set(ctx.spec.validation.class_axis) - {t.name for t in runner.outputs})
    if unknown:
        raise InvalidSpec(
            f"validation.class_axis names {unknown}, which are not outputs of the model",
            hint=f"Key it by the model's output names: {[t.name for t in runner.outputs]}.",
        )
    calibration = None
    if ctx.spec.calibration:
        calibration = load_calibration(ctx.extras.get("calibration_path", ctx.spec.calibration), runner.inputs)
    parity, calib, calibration_from = _split_samples(runner, ctx, calibration)
    inputs_from = parity.inputs_from
    shapes = f" at {len(parity.shapes)} shapes" if len(parity.shapes) > 1 else ""
    ctx.progress(f"running the {ctx.source.format.value} source on {len(parity.feeds)} samples{shapes} ({inputs_from})")
    outputs = _run_source(runner, parity, ctx)
    try:
        evaluation = _score_source(runner, ctx)
    finally:
        runner.close()
    runtime = getattr(runner, "runtime", None) or ctx.source.format.value
    passed_over = dict(getattr(runner, "passed_over", {}) or {})
    if passed_over:
        ctx.progress(
            f"the reference comes from {runtime}: " + "; ".join(f"{k} could not run the source" for k in passed_over)
        )
    refuse_nonfinite(outputs, inputs_from)
    feeds = parity.feeds
    noise_floor = _noise_floor(ctx, feeds, outputs, [t.name for t in runner.outputs])
    out = ctx.out_dir
    _save(out / "inputs.npz", _pack(feeds))
    _save(out / "outputs.npz", _pack(outputs))
    _save(out / "calibration.npz", _pack(calib))
    signature = {
        "inputs": [t.to_dict() for t in runner.inputs],
        "outputs": [t.to_dict() for t in runner.outputs],
    }
    (out / "signature.json").write_text(json.dumps(signature, indent=2))
    return Artifact(
        root=out,
        kind="reference",
        meta={
            "samples": len(feeds),
            "inputs_from": inputs_from,
            "calibration_samples": len(calib),
            "calibration_from": calibration_from,
            "source_format": ctx.source.format.value,
            "signature": signature,
            "shape_of": parity.shape_of,
            "shapes": parity.shapes,
            "input_provenance": parity.provenance,
            "evidence": parity.evidence,
            "noise_floor": noise_floor,
            "reference_runtime": runtime,
            "reference_passed_over": {k: v[:400] for k, v in passed_over.items()},
            **({"evaluation": evaluation} if evaluation else {}),
        },
    )
