"""What every exporter does after writing its files: parity against the source, benchmark."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from services.artifacts import Artifact
from services.benchmark import benchmark_runner, compare_with_fp32
from services.errors import ConversionFailed, InvalidModel, ParityFailed, SlowerThanFp32, SourceUnreadable
from services.formats import Format, sha256_path
from services.runners import ModelRunner, open_runner
from services.spec import Precision, Tolerances
from services.steps.context import StepContext
from services.steps.host_gate import host_alone
from services.steps.reference import ReferenceData, load_reference
from services.validation import check_parity
from services.validation.localize import describe
from services.validation.parity import ParityReport

__all__ = ["adapt_feed", "calibration_feeds", "calibration_warnings", "finish_export"]


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
    )


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
        ctx.progress(f"checking parity on {ref.samples} samples")
        checked, fixed = shapes_to_check(ref, runner)
        if fixed:
            warnings = [*(warnings or []), fixed]
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
        )
        parity.input_provenance = ref.input_provenance
        parity.reference_from = ref.reference_runtime
        parity.shapes = [ref.shapes[g] for g in sorted(checked) if g < len(ref.shapes)]
        parity.samples_per_shape = [sum(1 for i in use if ref.shape_of[i] == g) for g in sorted(checked)]
        if not parity.passed or ctx.spec.validation.localize:
            parity.localization = _localize(ctx, fmt, ctx.out_dir / entry, [ref.inputs[i] for i in use], parity, tol)
        if not parity.passed:
            where = describe(parity.localization)
            raise ParityFailed(
                f"{ctx.step.target} {precision.value} artifact differs from the source: "
                + "; ".join(parity.failures)
                + (f"; {where}" if where else ""),
                hint=parity.hint(),
                parity=parity.to_dict(),
                target=ctx.step.target,
            )
        bench = []
        vs_fp32 = None
        if ctx.spec.bench.enabled:
            ctx.progress("waiting for the other steps on this host to finish, to benchmark alone")
            with host_alone() as quiet:
                ctx.progress("benchmarking" if quiet.alone else "benchmarking beside other steps (host busy)")
                bench = [{**b.to_dict(), "alone": quiet.alone} for b in benchmark_runner(runner, ctx.spec)]
                if not quiet.alone:
                    warnings = [
                        *(warnings or []),
                        f"benchmarked beside other steps: the host stayed busy for {quiet.waited_s:.0f}s "
                        "(KILN_BENCH_QUIET_WAIT), so the latencies include their load",
                    ]
                if fp32_baseline is not None and precision is not Precision.FP32 and bench:
                    ctx.progress(f"timing {precision.value} against fp32 on the same engine")
                    vs_fp32 = _against_fp32(runner, fmt, fp32_baseline, runner_options, ctx, precision, bench)
        io = runner.io_contract()  # read from the artifact: what a serving client really feeds
    finally:
        runner.close()
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
            "benchmark": bench,
            "vs_fp32": vs_fp32,
            "serving": serving,
            "engine_details": engine_details or {},
            "warnings": list(warnings or []),
        },
    )
