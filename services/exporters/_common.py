"""What every exporter does after writing its files: parity against the source, benchmark."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from services.artifacts import Artifact
from services.benchmark import benchmark_runner, compare_with_fp32
from services.errors import ConversionFailed, InvalidModel, ParityFailed, SlowerThanFp32, SourceUnreadable
from services.formats import Format, sha256_path
from services.graph.device_checks import cpu_only_warning, device_bound
from services.runners import ModelRunner, open_runner
from services.spec import Precision, Tolerances
from services.steps.context import StepContext
from services.steps.host_gate import host_alone
from services.steps.reference import ReferenceData, load_reference
from services.validation import check_parity
from services.validation.localize import describe
from services.validation.parity import ParityReport

__all__ = [
    "accuracy_of",
    "accuracy_verdict",
    "adapt_feed",
    "benchmark_alone",
    "calibration_feeds",
    "calibration_warnings",
    "check_artifact_parity",
    "finish_export",
    "int8_search",
    "integer_io_kept",
    "score_artifact",
]


def integer_io_kept(io: dict[str, list[dict[str, Any]]]) -> str | None:
    """Return a warning naming the quantised integer inputs and outputs an artifact keeps, or None.

    Kiln's artifacts take and give float32 (the README's contract); one that keeps a
    quantised source's integer tensors (a .tflite published as it came) says so, with the
    scale and zero point a client converts with.
    """
    kept = [
        f"{side[:-1]} {t['name']} ({t['dtype']}, scale {q['scale']:.6g}, zero point {q['zero_point']})"
        for side in ("inputs", "outputs")
        for t in io.get(side, [])
        if (q := t.get("quantization"))
    ]
    if not kept:
        return None
    return (
        "the artifact keeps the source's quantised integer I/O, not float32: "
        + "; ".join(kept)
        + ". A client feeds round(x / scale) + zero_point and reads (q - zero_point) * scale"
    )


def adapt_feed(feed: dict[str, np.ndarray], runner: ModelRunner) -> dict[str, np.ndarray]:
    """Map reference inputs onto the artifact's inputs: by name, by spelling, else by position; cast dtypes.

    Converters respell names (onnx2tf writes ``past_key_values.0.key`` as
    ``past_key_values_0_key``) and a SavedModel signature lists its inputs in its own order, so
    names that match once punctuation and case are set aside pair up before position is used.
    """
    names = [t.name for t in runner.inputs]
    spelled = {_spelling(n): n for n in feed}
    if set(names) == set(feed):
        pairs = [(t, feed[t.name]) for t in runner.inputs]
    elif len(spelled) == len(feed) and {_spelling(n) for n in names} == set(spelled):
        pairs = [(t, feed[spelled[_spelling(t.name)]]) for t in runner.inputs]
    else:
        if len(names) != len(feed):
            raise ParityFailed(f"the artifact takes inputs {names}, the source {sorted(feed)}")
        pairs = list(zip(runner.inputs, feed.values(), strict=True))
    out = {}
    for t, arr in pairs:
        want = np.dtype(t.dtype) if t.dtype not in ("str", "bfloat16") else arr.dtype
        out[t.name] = arr.astype(want) if arr.dtype != want and want.kind in "fiub" else arr
    return out


def _spelling(name: str) -> str:
    """Return ``name`` without case and punctuation (``past_key_values.0.key`` -> ``pastkeyvalues0key``)."""
    return re.sub(r"[^0-9a-z]", "", name.lower())


def shapes_to_check(ref: ReferenceData, runner: ModelRunner) -> tuple[set[int], str | None]:
    """Return the reference's shapes the artifact accepts, and a warning when it is fixed to fewer.

    An artifact whose inputs fix an axis the source leaves open (onnx2tf's fixed-shape
    fallback, an engine built for one shape) is checked where it can run and says so; one
    that declares the axis open must run every shape the source ran, or it fails parity.
    """
    groups = set(ref.shape_of) or {0}
    if len(ref.shapes) <= 1:
        return groups, None
    declared = {t.name: t.shape for t in runner.inputs}
    spelled = {_spelling(n): s for n, s in declared.items()}
    accepted = set()
    for g in groups:
        shape = ref.shapes[g]
        ok = True
        for name, dims in shape.items():
            have = declared.get(name) or spelled.get(_spelling(name))
            if have is not None and len(have) == len(dims):
                ok = ok and all(h is None or h == d for h, d in zip(have, dims, strict=True))
        if ok or g == 0:
            accepted.add(g)
    if accepted == groups:
        return groups, None
    skipped = [ref.shapes[g] for g in sorted(groups - accepted)]
    return accepted, (
        f"fixed-shape artifact: its inputs are { ({n: list(s) for n, s in declared.items()}) }, so parity was checked "
        f"at {ref.shapes[0]} only; the source also runs {skipped}, which this artifact does not accept"
        + _served_lengths(ref, declared)
    )


def _served_lengths(ref: ReferenceData, declared: dict[str, tuple[int | None, ...]]) -> str:
    """Return what a fixed text artifact serves, in a user's terms: the sequence length, padding, other lengths."""
    source = {t.name: t.shape for t in ref.input_specs}
    fixed: dict[str, list[tuple[int, int]]] = {}
    for name, dims in declared.items():
        open_axes = source.get(name) or source.get(next((n for n in source if _spelling(n) == _spelling(name)), ""))
        if open_axes is None or len(open_axes) != len(dims):
            continue
        pinned = [(a, int(d)) for a, (o, d) in enumerate(zip(open_axes, dims, strict=True)) if o is None and d]
        if pinned:
            fixed[name] = pinned
    lengths = sorted({d for pins in fixed.values() for a, d in pins if a == 1})
    ids = next((n for n in fixed if "ids" in n.lower()), None)
    if not lengths or ids is None:
        return ""
    said = (
        f". It serves sequences of exactly {lengths[0]} tokens"
        if len(lengths) == 1
        else f". It serves lengths {lengths}"
    )
    masks = [n for n in declared if "mask" in n.lower()]
    if masks:
        said += f" (pad a shorter one to that length with {masks[0]} 0; outputs at padded positions mean nothing)"
    example = [1 if a == 0 else (d or -1) for a, d in enumerate(declared[ids])]
    example[1] = 128
    return (
        said + f"; to serve another length, compile with `inputs.{ids}.shape` at it (e.g. {example}), one "
        "compile per length: this engine's conversion could not keep the sequence axis open"
    )


def _evidence(ref: ReferenceData, ctx: StepContext, precision: Precision) -> dict[str, Any] | None:
    """Return what the verdict rests on; a reduced-precision artifact requires validation.min_unseen_samples."""
    if not ref.evidence:
        return None  # a reference from before the count was kept
    required = ctx.spec.validation.min_unseen_samples if precision is not Precision.FP32 else None
    level = f"{ctx.spec.validation.confidence:.0%}"
    return {
        **ref.evidence,
        "required": required,
        "interval": f"one-sided {level} prediction bound per measure (Student t on the error's amplitude over "
        "the samples); the gate decides on its pessimistic end",
    }


def calibration_feeds(ref: ReferenceData) -> tuple[list[dict[str, np.ndarray]], str]:
    """Return the samples int8 calibration uses (never the parity samples) and where they came from."""
    return ref.calibration, ref.calibration_from


def calibration_warnings(label: str) -> list[str]:
    """Return the warning an int8 artifact calibrated on generated samples carries (none for real data)."""
    if label.startswith("generated"):
        return [
            "int8 was calibrated on generated samples, not real data: activation ranges may not match real "
            "inputs; give `calibration` (an .npz of real inputs) for a trustworthy int8 artifact"
        ]
    return []


def _localize(
    ctx: StepContext,
    fmt: Format,
    artifact: Path,
    feeds: list[dict[str, np.ndarray]],
    parity: ParityReport,
    tol: Tolerances,
) -> dict[str, Any] | None:
    """Return where the artifact first drifts from the fp32 ONNX graph it was exported from (None: not ONNX-family).

    Runs on the feed holding the worst sample of the worst output. A failure here is
    reported in the result, never in place of the parity verdict.
    """
    model = ctx.inputs.get("model")
    if model is None or model.kind != Format.ONNX.value or fmt not in (Format.ONNX, Format.OPENVINO_IR):
        return None
    from services.validation.localize import localize_divergence

    worst = min(parity.outputs, key=lambda o: o.snr_db if o.snr_db is not None else float("inf"), default=None)
    row = worst.worst_sample if worst is not None and worst.worst_sample is not None else 0
    feed = feeds[min(_feed_of_row(feeds, row), len(feeds) - 1)] if feeds else {}
    ctx.progress("parity: looking for the first node that drifts from the fp32 graph")
    try:
        return localize_divergence(model.path, artifact, fmt, feed, tol)
    except Exception as exc:  # a tool error must not hide the verdict it was asked to explain
        return {"node": None, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def _feed_of_row(feeds: list[dict[str, np.ndarray]], row: int) -> int:
    """Return the index of the feed holding sample ``row`` (samples are the rows of each feed's batch axis)."""
    seen = 0
    for i, feed in enumerate(feeds):
        first = next(iter(feed.values()), None)
        n = int(first.shape[0]) if first is not None and first.ndim >= 2 and first.shape[0] > 1 else 1
        if row < seen + n:
            return i
        seen += n
    return len(feeds) - 1


def _against_fp32(
    runner: ModelRunner,
    fmt: Format,
    baseline: Path,
    runner_options: dict[str, Any] | None,
    ctx: StepContext,
    precision: Precision,
    bench: list[dict[str, Any]],
) -> dict[str, Any]:
    fp32 = open_runner(fmt, baseline, **(runner_options or {}))
    try:
        sizes = [int(b["batch_size"]) for b in bench]
        result = compare_with_fp32(runner, fp32, ctx.spec, precision.value, sizes)
    finally:
        fp32.close()
    if ctx.spec.bench.require_no_slower_than_fp32 and result["verdict"] == "slower":
        worst = min(result["rows"], key=lambda r: r["speedup"])
        raise SlowerThanFp32(
            f"{ctx.step.target} {precision.value} artifact is slower than fp32 on the same engine: "
            f"{worst['p50_ms']:.3f} ms against {worst['fp32_p50_ms']:.3f} ms at batch {worst['batch_size']}",
            vs_fp32=result,
            target=ctx.step.target,
        )
    return result


def accuracy_of(
    ctx: StepContext, ref: ReferenceData, *, search: bool = False
) -> Callable[[list[np.ndarray]], dict[str, Any]] | None:
    """Return what scores an artifact's outputs on the spec's labelled data (one array per feed of the scored
    output) into the evaluation report against the source's score; None without ``evaluation`` (and, for
    ``search``, when the spec turns the accuracy-aware int8 search off)."""
    evaluation, data = ctx.spec.evaluation, ref.evaluation
    if evaluation is None or data is None or (search and not evaluation.accuracy_aware_int8):
        return None
    from services.validation.evaluation import evaluation_report
    from services.validation.task_metrics import Score, score

    source = Score(data.source_value, int(data.source["counted"]), data.source_per_feed)

    def report(outputs: list[np.ndarray]) -> dict[str, Any]:
        return evaluation_report(evaluation, data.output, data.samples, source, score(outputs, data.labels, evaluation))

    return report


def accuracy_verdict(report: dict[str, Any]) -> dict[str, Any]:
    """Return the part of an evaluation report an int8 search ranks its attempts by."""
    return {
        "metric": report["metric"],
        "score": report.get("artifact"),
        "drop": report.get("drop"),
        "within_max_drop": bool(report.get("passed")),
    }


def int8_search(engine_details: dict[str, Any]) -> dict[str, Any] | None:
    """Return what the accuracy-aware int8 search did, from an export's engine details: the plain int8 score, the
    score reached, what stayed in float (None when the export ran no search on labelled data)."""
    int8 = engine_details.get("int8")
    if not isinstance(int8, dict):
        return None
    control = int8.get("accuracy_control")
    if isinstance(control, dict):
        return {
            "tool": control["tool"],
            "needed": control.get("needed"),
            "plain_int8": control.get("plain_int8"),
            "reached": control.get("reached"),
            "left_in_float": len(control.get("left_in_float") or []),
            "selected_on_evaluation_data": True,
        }
    auto = int8.get("auto_exclude")
    if not isinstance(auto, dict) or not auto.get("attempts") or "drop" not in auto["attempts"][0]:
        return None
    first, reached = auto["attempts"][0], auto.get("reached") or {}
    return {
        "tool": "onnxruntime auto_exclude",
        "needed": auto.get("needed"),
        "plain_int8": {k: first.get(k) for k in ("score", "drop", "within_max_drop")},
        "reached": {k: reached.get(k) for k in ("score", "drop", "within_max_drop")},
        "left_in_float": len(auto.get("left_in_float") or []),
        "calibration_method": int8.get("calibration_method"),
        "attempts": len(auto["attempts"]),
        "selected_on_evaluation_data": True,
    }


def _judged(
    ctx: StepContext, ref: ReferenceData, runner: ModelRunner, engine_details: dict[str, Any] | None
) -> dict[str, Any] | None:
    """Return the artifact's evaluation report with what the int8 search did (None without ``evaluation``)."""
    evaluation = score_artifact(ctx, ref, runner)
    if evaluation is not None:
        search = int8_search(engine_details or {})
        if search:
            evaluation["int8_search"] = search
    return evaluation


def score_artifact(ctx: StepContext, ref: ReferenceData, runner: ModelRunner) -> dict[str, Any] | None:
    """Return the artifact's score on the spec's labelled data against the source's (None without ``evaluation``)."""
    scorer, evaluation, data = accuracy_of(ctx, ref), ctx.spec.evaluation, ref.evaluation
    if scorer is None or evaluation is None or data is None:
        return None
    from services.validation.evaluation import artifact_output

    name = artifact_output(data.output, ref.output_names, [t.name for t in runner.outputs])
    ctx.progress(f"scoring {evaluation.metric.value} on {data.samples} labelled samples")
    report = scorer([np.asarray(runner.run(adapt_feed(feed, runner))[name]) for feed in data.feeds])
    ctx.progress(
        f"{evaluation.metric.value}: artifact {report['artifact']}, source {report['source']}, drop {report['drop']} "
        f"(max_drop {evaluation.max_drop})"
    )
    return report


def _copied_input(ctx: StepContext, written: Path) -> bool:
    """Return True when ``written`` is byte for byte the step's input model (an fp32 export copies it)."""
    try:
        source = ctx.model.path
    except KeyError:
        return False
    if not (source.is_file() and written.is_file()) or source.stat().st_size != written.stat().st_size:
        return False
    return sha256_path(source) == sha256_path(written)


def finish_export(
    ctx: StepContext,
    *,
    fmt: Format,
    entry: str,
    precision: Precision,
    serving: dict[str, Any],
    runner_options: dict[str, Any] | None = None,
    engine_details: dict[str, Any] | None = None,
    warnings: list[str] | None = None,
    fp32_baseline: Path | None = None,
) -> Artifact:
    """Validate the artifact at ``ctx.out_dir/entry`` against the reference, benchmark it, describe it.

    Raises PARITY_FAILED with the numbers when the artifact disagrees with the source beyond
    the spec's tolerances for ``precision``. ``warnings`` (a fallback the exporter took, data
    it had to make up) reach the manifest, the job's target result and the CLI summary. With
    ``fp32_baseline`` (the same model at fp32, in ``fmt``) a reduced-precision artifact is also
    timed against it side by side (``vs_fp32``: which to deploy); SLOWER_THAN_FP32 when the spec
    requires it not to be slower.
    """
    ref = load_reference(ctx.reference)
    try:
        runner = open_runner(fmt, ctx.out_dir / entry, **(runner_options or {}))
    except (SourceUnreadable, InvalidModel) as exc:
        if _copied_input(ctx, ctx.out_dir / entry):
            raise  # the step's input as it came: the executor says whose it is (the source's, a step's)
        # The artifact this step wrote: its tool made something its own runtime cannot load.
        # (Left as it is, the executor would blame the step that wrote this step's input.)
        raise ConversionFailed(
            f"{ctx.step.tool or ctx.step.id} wrote a {fmt.value} artifact that {fmt.value}'s runtime cannot load: "
            f"{exc.message}",
            hint="The converter accepted the model but produced something its runtime refuses; another route "
            "or target may avoid it.",
            step=ctx.step.id,
            tool=ctx.step.tool,
            output_tail=exc.message[-2000:],
        ) from exc
    try:
        try:
            parity, fixed = check_artifact_parity(ctx, runner, ref, precision, fmt=fmt, artifact=ctx.out_dir / entry)
        except ParityFailed as exc:
            # Scored all the same: the job says how much accuracy the refused artifact keeps, and a loss
            # past max_drop (the user's own bound) is the failure it names, parity's numbers beside it.
            evaluation = _judged(ctx, ref, runner, engine_details)
            if evaluation is not None:
                exc.details["evaluation"] = evaluation
                from services.validation.evaluation import check_drop

                check_drop(evaluation, ctx.step.target, precision.value, parity=exc.details.get("parity"))
            raise
        if fixed:
            warnings = [*(warnings or []), fixed]
        evaluation = _judged(ctx, ref, runner, engine_details)
        if evaluation is not None:
            from services.validation.evaluation import check_drop

            check_drop(evaluation, ctx.step.target, precision.value, parity=parity.to_dict())
        bench = []
        vs_fp32 = None
        if ctx.spec.bench.enabled:
            ctx.progress("waiting for the other steps on this host to finish, to benchmark alone")
            with host_alone() as quiet:
                ctx.progress("benchmarking" if quiet.alone else "benchmarking beside other steps (host busy)")
                bench = [{**b.to_dict(), "alone": quiet.alone} for b in benchmark_runner(runner, ctx.spec)]
                if not quiet.alone:
                    warnings = [*(warnings or []), _busy_warning(quiet.waited_s)]
                if fp32_baseline is not None and precision is not Precision.FP32 and bench:
                    ctx.progress(f"timing {precision.value} against fp32 on the same engine")
                    vs_fp32 = _against_fp32(runner, fmt, fp32_baseline, runner_options, ctx, precision, bench)
        io = runner.io_contract()  # read from the artifact: what a serving client really feeds
        kept = integer_io_kept(io)
        if kept and not (precision is Precision.INT8 and ctx.spec.integer_io):
            warnings = [*(warnings or []), kept]
    finally:
        runner.close()
    device_check = None
    bound = device_bound(ctx.step.target, ctx.spec) if ctx.step.target else None
    if bound is not None:
        # Checked here, on the CPU: a GPU check step that follows (services/exporters/device_check.py)
        # replaces this record and drops the warning; without one, the version says so.
        warnings = [*(warnings or []), cpu_only_warning(ctx.step.target or "", ctx.spec, bound)]
        device_check = {"checked_on": "cpu", "device_bound": bound}
    return Artifact(
        root=ctx.out_dir,
        kind=fmt.value,
        entry=entry,
        meta={
            "target": ctx.step.target,
            "format": fmt.value,
            "precision": precision.value,
            "io": io,
            "parity": parity.to_dict(),
            **({"evaluation": evaluation} if evaluation is not None else {}),
            "benchmark": bench,
            "vs_fp32": vs_fp32,
            "serving": serving,
            "engine_details": engine_details or {},
            "warnings": list(warnings or []),
            "device_check": device_check,
        },
    )


def check_artifact_parity(
    ctx: StepContext, runner: ModelRunner, ref: ReferenceData, precision: Precision, *, fmt: Format, artifact: Path
) -> tuple[ParityReport, str | None]:
    """Return the parity of ``runner`` against the reference, and a warning when it takes fewer shapes.

    Raises PARITY_FAILED with the numbers (and, for ONNX-family artifacts, the first divergent node)
    when it disagrees beyond the spec's tolerances for ``precision``.
    """
    ctx.progress(f"checking parity on {ref.samples} samples")
    checked, fixed = shapes_to_check(ref, runner)
    use = [i for i, g in enumerate(ref.shape_of) if g in checked]
    actual = [runner.run(adapt_feed(ref.inputs[i], runner)) for i in use]
    tol = ctx.spec.tolerances_for(precision)
    parity = check_parity(
        actual,
        [ref.outputs[i] for i in use],
        tol,
        inputs_from=ref.inputs_from,
        output_order=[t.name for t in runner.outputs],
        expected_order=ref.output_names,
        raise_on_failure=False,
        class_axes=ctx.spec.validation.class_axis,
        confidence=ctx.spec.validation.confidence,
        evidence=_evidence(ref, ctx, precision),
        noise_floor=ref.noise_floor,
    )
    parity.input_provenance = ref.input_provenance
    parity.reference_from = ref.reference_runtime
    parity.shapes = [ref.shapes[g] for g in sorted(checked) if g < len(ref.shapes)]
    parity.samples_per_shape = [sum(1 for i in use if ref.shape_of[i] == g) for g in sorted(checked)]
    if not parity.passed or ctx.spec.validation.localize:
        parity.localization = _localize(ctx, fmt, artifact, [ref.inputs[i] for i in use], parity, tol)
    if not parity.passed:
        where = describe(parity.localization)
        raise ParityFailed(
            f"{ctx.step.target} {precision.value} artifact differs from the source: "
            + "; ".join(parity.failures)
            + (f"; {where}" if where else ""),
            hint=parity.hint(precision.value),
            parity=parity.to_dict(),
            target=ctx.step.target,
        )
    return parity, fixed


def benchmark_alone(ctx: StepContext, runner: ModelRunner) -> tuple[list[dict[str, Any]], str | None]:
    """Return the benchmark rows of ``runner`` timed with no other step on this host, and a warning when it never was."""
    ctx.progress("waiting for the other steps on this host to finish, to benchmark alone")
    with host_alone() as quiet:
        ctx.progress("benchmarking" if quiet.alone else "benchmarking beside other steps (host busy)")
        bench = [{**b.to_dict(), "alone": quiet.alone} for b in benchmark_runner(runner, ctx.spec)]
    return bench, None if quiet.alone else _busy_warning(quiet.waited_s)


def _busy_warning(waited_s: float) -> str:
    return (
        f"benchmarked beside other steps: the host stayed busy for {waited_s:.0f}s "
        "(KILN_BENCH_QUIET_WAIT), so the latencies include their load"
    )
