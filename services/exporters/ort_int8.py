"""onnxruntime static int8: quantize_static with the spec's choices, and the exclusion fallback.

``quantize_int8`` maps ``options.onnxruntime.int8`` onto onnxruntime.quantization's own
arguments. ``quantize_with_exclusion`` checks the result against the fp32 model on the
calibration samples (never the parity samples, which stay held out for the export's gate) and,
when it disagrees beyond the parity bounds, ranks the nodes by how much signal-to-noise they lose
once quantised (onnxruntime.quantization.qdq_loss_debug: each quantised activation against the
fp32 model's) and quantises again with the worst left in float, for a bounded number of rounds.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from services.descriptors.onnxruntime import OnnxRuntimeInt8Options
from services.errors import ConversionFailed, KilnError
from services.onnx_io import load_onnx, save_onnx
from services.spec import Tolerances

__all__ = [
    "ACCURACY_CHECK_SAMPLES",
    "CHECK_MARGIN_DB",
    "CHECK_SAMPLES",
    "PER_CHANNEL_OPSET",
    "Judge",
    "evaluation_judge",
    "quantize_int8",
    "quantize_with_exclusion",
    "rank_sensitive_nodes",
]

PER_CHANNEL_OPSET = 13  # DequantizeLinear's `axis` (per-channel scales) came in opset 13

#: Samples the fallback runs through both models per check and per ranking: enough to see a
#: node that loses the signal, few enough that each of a detector's intermediate tensors fits.
CHECK_SAMPLES = 8
RANK_SAMPLES = 2
#: Judged on labelled data too, a search checks parity on this many calibration samples: selecting
#: on accuracy, 8 in-sample rows passed int8 magika artifacts the gate then refused on held-out rows
#: (OpenVINO: cosine 0.59 on one; onnxruntime: slope 1.13), and 48 did not.
ACCURACY_CHECK_SAMPLES = 48
#: What the fallback's own check adds to the SNR bound, since it runs on in-sample data.
CHECK_MARGIN_DB = 2.0
#: Share of the graph's nodes the first round leaves in float; each later round doubles it.
FIRST_ROUND_SHARE = 0.02
#: Each round after the first also tries leaving every node of the op types that lose most in float.
OP_TYPE_CANDIDATES = 2
#: An SNR above this is as good as exact (float rounding); it caps a node's inherited SNR.
EXACT_DB = 100.0

# MinMax stays the default calibration: measured on held-out rows, the alternatives were no
# better and some worse. The tests' CNN, transformer block and two-input Keras model gave the
# same cosine to 1e-5 with Percentile (99.99 / 99.999); on MobileNetV2 0.35 (five calibration
# draws) Percentile moved cosine by less than the draw-to-draw spread (MinMax 0.958-0.975).
# Entropy, through quantize_static, keeps ORT's fixed 128 bins for 128 quantized bins and so
# reduces to MinMax exactly. On real models with outlier activations Percentile does help
# (PP-OCRv4 det 5.0 -> 8.8 dB, docs/benchmarks.md): it is options.onnxruntime.int8's to choose.
_CALIBRATE = {"minmax": "MinMax", "entropy": "Entropy", "percentile": "Percentile"}


class _Feeds:
    """onnxruntime's CalibrationDataReader protocol over a list of feeds."""

    def __init__(self, feeds: Sequence[dict[str, np.ndarray]]) -> None:
        self._feeds = list(feeds)
        self._it = iter(self._feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._it, None)

    def rewind(self) -> None:
        self._it = iter(self._feeds)

    def __iter__(self) -> Any:  # qdq_loss_debug.collect_activations iterates the reader
        return iter(self._feeds)


def preprocess(src: Path, scratch: Path) -> tuple[Path, dict[str, object] | None]:
    """Return onnxruntime's pre-processed copy of ``src`` (every node named) and any opset upgrade done."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    pre = scratch / "preprocessed.onnx"
    quant_pre_process(str(src), str(pre), skip_symbolic_shape=True)
    upgrade = _opset_for_per_channel(pre)
    model = load_onnx(pre)
    seen = {n.name for n in model.graph.node if n.name}
    renamed = False
    for i, node in enumerate(model.graph.node):
        if not node.name:
            # quantize_static excludes nodes by name: an unnamed node could be neither excluded nor reported.
            name = f"{node.op_type}_{i}"
            while name in seen:
                name += "_"
            node.name = name
            seen.add(name)
            renamed = True
    if renamed:
        save_onnx(model, pre)
    return pre, upgrade


def quantize_int8(
    src: Path,
    dst: Path,
    feeds: list[dict[str, np.ndarray]],
    scratch: Path,
    options: OnnxRuntimeInt8Options | None = None,
    *,
    exclude: Sequence[str] = (),
    preprocessed: tuple[Path, dict[str, object] | None] | None = None,
) -> dict[str, object]:
    """Quantise ``src`` to int8 with static calibration on ``feeds``; return the settings used.

    ``exclude``: node names (of the pre-processed graph) left in float beside the options' own.
    """
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    opts = options or OnnxRuntimeInt8Options()
    pre, upgrade = preprocessed or preprocess(src, scratch)
    nodes = list(load_onnx(pre, load_external_data=False).graph.node)
    names = {n.name for n in nodes}
    by_type = [n.name for n in nodes if n.op_type in set(opts.op_types_to_exclude)]
    excluded = list(dict.fromkeys([*opts.nodes_to_exclude, *by_type, *exclude]))
    settings: dict[str, object] = {
        "format": "QDQ" if opts.quant_format == "qdq" else "QOperator",
        "activations": "QUInt8" if not opts.activation_symmetric else "QInt8",
        "activation_symmetric": opts.activation_symmetric,
        "weights": "QInt8",
        "per_channel": opts.per_channel,
        "calibration_method": _CALIBRATE[opts.calibrate_method],
        "samples": len(feeds),
        "nodes_excluded": len([n for n in excluded if n in names]),
    }
    missing = [n for n in opts.nodes_to_exclude if n not in names]
    if missing:
        settings["nodes_to_exclude_not_found"] = missing[:50]
    if upgrade is not None:
        settings["opset_upgrade"] = upgrade
        settings["per_channel"] = opts.per_channel and upgrade["to"] == PER_CHANNEL_OPSET
    extra: dict[str, object] = {}
    if opts.activation_symmetric:
        extra["ActivationSymmetric"] = True
    if opts.calibrate_method == "percentile":
        extra["CalibPercentile"] = 99.999

    def quantize(more: dict[str, object]) -> None:
        quantize_static(
            str(pre),
            str(dst),
            _Feeds(feeds),
            quant_format=QuantFormat.QDQ if opts.quant_format == "qdq" else QuantFormat.QOperator,
            # Symmetric activations in uint8 would pin the zero point at 128 and waste half the range.
            activation_type=QuantType.QInt8 if opts.activation_symmetric else QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            per_channel=bool(settings["per_channel"]),
            calibrate_method=getattr(CalibrationMethod, _CALIBRATE[opts.calibrate_method]),
            nodes_to_exclude=[n for n in excluded if n in names],
            extra_options={**extra, **more},
        )

    try:
        try:
            quantize({})
        except ValueError as exc:
            if "truth value of an array" not in str(exc) or opts.quant_format != "qdq":
                raise
            # onnxruntime's int32-bias weight-scale adjustment indexes a bias as if it were 1-D; a
            # Gemm bias shaped [1, N] (as Paddle and older exporters write it) makes it compare
            # arrays (measured with onnxruntime 1.32 on PP-OCR models and a one-Gemm graph). Without
            # the adjustment a bias past int32 at the chosen scales is clipped, which the parity gate
            # then sees; the manifest records that it was skipped. QOperator has no such switch.
            settings["int32_bias_weight_adjustment"] = "skipped: onnxruntime cannot adjust a bias that is not 1-D"
            quantize({"QDQDisableWeightAdjustForInt32Bias": True})
    except KilnError:
        raise
    except Exception as exc:  # the quantiser's own limits (e.g. Entropy's "Too many bins") are the user's to see
        raise ConversionFailed(
            f"onnxruntime could not quantise the model ({settings['format']}, {settings['calibration_method']}): "
            f"{type(exc).__name__}: {str(exc)[:300]}",
            hint="Try other options.onnxruntime.int8 (calibrate_method minmax, quant_format qdq, per_channel false), "
            "or leave the node it names in float with nodes_to_exclude.",
            tool="onnxruntime.quantization",
        ) from exc
    return settings


def _opset_for_per_channel(path: Path) -> dict[str, object] | None:
    """Upgrade the model at ``path`` in place to opset 13 when it is older; return what was done.

    onnxruntime's quantiser writes per-channel DequantizeLinear nodes with an ``axis`` whatever
    the model's opset, and below opset 13 onnxruntime then refuses the graph it wrote
    (INVALID_GRAPH: "Unrecognized attribute: axis"). When the converter cannot upgrade the
    graph, quantisation stays per-tensor, which every opset accepts.
    """
    from services.passes.opset_upgrade import upgrade_opset

    model = load_onnx(path)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), PER_CHANNEL_OPSET)
    if opset >= PER_CHANNEL_OPSET:
        return None
    try:
        upgraded, _ = upgrade_opset(model, minimum=PER_CHANNEL_OPSET)
    except KilnError as exc:
        return {"from": opset, "to": opset, "why": f"per-tensor weights: the opset could not be upgraded ({exc})"}
    save_onnx(upgraded, path)
    return {"from": opset, "to": PER_CHANNEL_OPSET, "why": "per-channel int8 weights need DequantizeLinear's axis"}


def _run(path: Path, feeds: Sequence[dict[str, np.ndarray]], *, optimized: bool = True) -> list[dict[str, np.ndarray]]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if not optimized:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    wanted = {i.name for i in sess.get_inputs()}
    return [dict(zip(names, sess.run(None, {k: v for k, v in f.items() if k in wanted}), strict=True)) for f in feeds]


def _cannot_run(path: Path, feeds: Sequence[dict[str, np.ndarray]]) -> str | None:
    """Return why onnxruntime cannot load or run the model at ``path`` on ``feeds`` (None: it runs).

    Run twice: optimised, and with no graph optimisation, as a server set to another level (or
    the ranking's debug sessions) would; a graph that runs only once onnxruntime has folded it
    is not sound.
    """
    try:
        _run(path, feeds)
        _run(path, feeds[:1], optimized=False)
    except Exception as exc:  # onnxruntime's own error types; the message is what the user needs
        text = str(exc)
        if "Status Message:" not in text:
            return text[:300]
        # The node it names, then the kernel's own words (the end: the source location comes first).
        where, _, why = text.partition("Status Message:")
        return f"{where[where.find('running') :][:160].strip()} {why.strip()[-200:]}"
    return None


#: Scores a quantised model file: a verdict with ``passed`` and, judged on labelled data, ``drop``.
Judge = Callable[[Path], dict[str, Any]]


def _rank_key(verdict: dict[str, Any]) -> tuple[bool, bool, float, float]:
    """Order attempts: a pass first; then, on labelled data, the one within max_drop and the smaller drop; then SNR."""
    snr = verdict.get("worst_snr_db")
    snr_key = float(snr) if snr is not None else -math.inf
    if "drop" not in verdict:
        return (bool(verdict["passed"]), True, 0.0, snr_key)
    drop = verdict["drop"]
    return (
        bool(verdict["passed"]),
        bool(verdict["within_max_drop"]),
        -float(drop) if drop is not None else -math.inf,
        snr_key,
    )


def _check(
    quantized: Path, feeds: Sequence[dict[str, np.ndarray]], expected: list[dict[str, np.ndarray]], tol: Tolerances
) -> dict[str, Any]:
    """Return the parity verdict of ``quantized`` against the fp32 outputs ``expected`` on ``feeds``."""
    from services.validation import check_parity

    report = check_parity(_run(quantized, feeds), expected, tol, inputs_from="calibration", raise_on_failure=False)
    snrs = [o.snr_db for o in report.outputs if o.snr_db is not None]
    pearsons = [o.pearson for o in report.outputs if o.pearson is not None]
    return {
        "passed": report.passed,
        "worst_snr_db": round(min(snrs), 2) if snrs else None,
        "worst_pearson": round(min(pearsons), 4) if pearsons else None,
        "failures": report.failures[:3],
    }


_QDQ_SUFFIXES = ("_DequantizeLinear_Output_1", "_DequantizeLinear_Output", "_QuantizeLinear_Input")


def _float_name(name: str) -> str:
    """Return the fp32 graph's name of a tensor the quantiser renamed (``x_DequantizeLinear_Output`` -> ``x``)."""
    for suffix in _QDQ_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def rank_sensitive_nodes(
    float_model: Path, qdq_model: Path, feeds: Sequence[dict[str, np.ndarray]], scratch: Path
) -> list[tuple[str, float, list[str]]]:
    """Return the int8 graph's nodes by the SNR (dB) they lose against fp32, worst first, with their int8 producers.

    A node's loss is the lowest SNR among its inputs as the int8 model feeds them (after their
    DequantizeLinear) minus the SNR of its output as its consumers read it (after its own
    QuantizeLinear/DequantizeLinear pair): what its int8 weights and arithmetic and its output's
    rounding add. Measured on the nodes of the quantised graph, since the quantiser fuses some
    (a Relu into the Conv before it). Every tensor is saved and compared with onnxruntime's
    qdq_loss_debug tools, one feed at a time so a detector's intermediates fit in memory.

    The third item names the nodes whose quantised outputs the node reads: a node left in float
    that still loses reads a tensor rounded for them, and only excluding them too removes that.
    """
    from onnxruntime.quantization.qdq_loss_debug import collect_activations, modify_model_output_intermediate_tensors

    aug_f, aug_q = scratch / "rank-float.onnx", scratch / "rank-int8.onnx"
    modify_model_output_intermediate_tensors(str(float_model), str(aug_f))
    modify_model_output_intermediate_tensors(str(qdq_model), str(aug_q))
    signal: dict[str, float] = {}
    noise: dict[str, float] = {}
    for feed in feeds:
        ref = collect_activations(str(aug_f), _Feeds([feed]))
        got = collect_activations(str(aug_q), _Feeds([feed]))
        for name, values in got.items():
            want = ref.get(_float_name(name))
            if want is None or want[0].shape != values[0].shape or not np.issubdtype(values[0].dtype, np.floating):
                continue
            x = want[0].astype(np.float64)
            signal[name] = signal.get(name, 0.0) + float(np.sum(x * x))
            noise[name] = noise.get(name, 0.0) + float(np.sum((x - values[0]) ** 2))
        del ref, got

    def snr(name: str) -> float | None:
        if name not in signal:
            return None
        if noise[name] <= signal[name] * 10 ** (-EXACT_DB / 10):
            return EXACT_DB
        ratio = max(signal[name], 1e-30) / noise[name]
        if not math.isfinite(ratio) or ratio <= 0:  # an inf or NaN in the int8 tensor (or the fp32 one)
            return -EXACT_DB
        return max(10 * math.log10(ratio), -EXACT_DB)

    def as_read(output: str) -> str:
        # What consumers read: the DequantizeLinear after the output's own QuantizeLinear, when there is one.
        for name in (output + "_DequantizeLinear_Output", _float_name(output)):
            if name in signal:
                return name
        return output

    nodes = [n for n in load_onnx(qdq_model, load_external_data=False).graph.node]
    producer = {o: n.name for n in nodes if n.op_type not in ("QuantizeLinear", "DequantizeLinear") for o in n.output}
    losses = []
    for node in nodes:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
            continue
        outs = [v for v in (snr(as_read(o)) for o in node.output) if v is not None]
        if not outs:
            continue
        ins = [v for v in (snr(i) for i in node.input) if v is not None]
        rounded = [_float_name(i) for i in node.input if i != _float_name(i)]
        upstream = [p for t in rounded for p in (producer.get(t), producer.get(t + "_QuantizeLinear_Input")) if p]
        losses.append((node.name, round((min(ins) if ins else EXACT_DB) - min(outs), 2), upstream))
    return sorted(losses, key=lambda x: -x[1])


def quantize_with_exclusion(
    src: Path,
    dst: Path,
    feeds: list[dict[str, np.ndarray]],
    scratch: Path,
    options: OnnxRuntimeInt8Options,
    tol: Tolerances,
    progress: Callable[[str], None] = lambda _m: None,
    probe: Sequence[dict[str, np.ndarray]] = (),
    accuracy: Judge | None = None,
) -> dict[str, object]:
    """Quantise ``src`` to ``dst``; if it misses ``tol`` against fp32 on the calibration samples, leave nodes in float.

    ``probe``: feeds the artifact must also run on (the parity feeds, whose batch may be larger
    than the calibration samples'); only whether it runs is asked of them, never its outputs.
    ``accuracy``: the spec's evaluation as a judge (:func:`evaluation_judge`); an attempt then
    passes only within evaluation.max_drop on the labelled data as well, and attempts rank by
    that drop before the calibration samples' SNR.

    When MinMax calibration misses, Percentile is tried once (``auto_percentile``) and the
    search goes on from the better of the two. Returns the settings, with ``auto_exclude``:
    each attempt's verdict and, when nodes were left in float by it, which and what each lost
    when quantised. The artifact left at ``dst`` is the first attempt that passed, else the best.
    """
    pre = preprocess(src, scratch)
    settings = quantize_int8(src, dst, feeds, scratch, options, preprocessed=pre)
    runs_on = [*feeds[:1], *probe]
    refused = _cannot_run(dst, runs_on)
    if refused and options.per_channel:
        # onnxruntime 1.32 gives a [1, N] constant (magika's Dense bias, named after the Reshape that
        # made it) per-channel scales on axis 0, of N entries; its own DequantizeLinear kernel then
        # refuses them ("scale must be 1D tensor with size 1") unless constant folding hides it.
        # Per-tensor scales run.
        options = options.model_copy(update={"per_channel": False})
        settings = quantize_int8(src, dst, feeds, scratch, options, preprocessed=pre)
        settings["per_channel_refused"] = f"onnxruntime cannot run its own per-channel graph: {refused}"
        refused = _cannot_run(dst, runs_on)
    if refused:
        raise ConversionFailed(
            f"onnxruntime cannot run the int8 graph its quantiser wrote: {refused}",
            hint="Try other options.onnxruntime.int8 (quant_format qdq, per_channel false), or compile at fp32/fp16.",
            tool="onnxruntime.quantization",
        )
    if not options.auto_exclude:
        return settings
    check_feeds = feeds[: CHECK_SAMPLES if accuracy is None else ACCURACY_CHECK_SAMPLES]
    expected = _run(pre[0], check_feeds)
    if tol.min_snr_db is not None:
        # The calibration samples set the ranges they are checked on: in sample, int8 looks better
        # than on the held-out parity samples (PP-OCRv4 det, Percentile: 9.65 dB here, 8.8 there).
        tol = tol.model_copy(update={"min_snr_db": tol.min_snr_db + CHECK_MARGIN_DB})

    def judge(path: Path) -> dict[str, Any]:
        verdict = _check(path, check_feeds, expected, tol)
        if accuracy is None:
            return verdict
        # The export's gate checks parity after this search: an attempt within max_drop that the
        # gate would refuse is no answer, so both must hold.
        scored = accuracy(path)
        parity_passed = verdict.pop("passed")
        return {
            **scored,
            "passed": bool(scored["within_max_drop"] and parity_passed),
            "parity_passed": parity_passed,
            **verdict,
        }

    verdict = judge(dst)
    attempts: list[dict[str, Any]] = [{"excluded": 0, **verdict}]
    report: dict[str, Any] = {
        "attempts": attempts,
        "checked_on": f"{len(check_feeds)} calibration samples against fp32, SNR bound raised {CHECK_MARGIN_DB} dB"
        + (" and the evaluation's labelled data against evaluation.max_drop" if accuracy is not None else ""),
    }
    settings["auto_exclude"] = report
    if verdict["passed"]:
        report["needed"] = False
        report["reached"] = verdict
        return settings
    report["needed"] = True
    graph_nodes = list(load_onnx(pre[0], load_external_data=False).graph.node)
    op_type = {n.name: n.op_type for n in graph_nodes}
    chosen: dict[str, str] = {}  # node -> why it is left in float
    best: dict[str, Any] = {
        "key": _rank_key(verdict),
        "file": None,
        "chosen": {},
        "settings": settings,
        "verdict": verdict,
    }
    attempt_dir = scratch / "attempts"
    attempt_dir.mkdir(exist_ok=True)
    qdq_for_rank = dst
    if options.auto_percentile and options.calibrate_method == "minmax":
        # Outlier activations stretch MinMax ranges; Percentile clips them (PP-OCRv4 det: 7.9 -> 10.9 dB).
        progress("int8 misses with MinMax calibration: trying Percentile")
        percentile = options.model_copy(update={"calibrate_method": "percentile"})
        out = attempt_dir / "percentile.onnx"
        attempt = quantize_int8(src, out, feeds, scratch, percentile, preprocessed=pre)
        if _cannot_run(out, runs_on) is None:
            tried = judge(out)
            attempts.append({"tried": "Percentile calibration", "excluded": 0, **tried})
            if _rank_key(tried) > best["key"]:
                options = percentile
                best = {"key": _rank_key(tried), "file": out, "chosen": {}, "settings": attempt, "verdict": tried}
                qdq_for_rank = out if options.quant_format == "qdq" else qdq_for_rank
    rounds = 0 if best["key"][0] else options.auto_exclude_rounds
    for round_ in range(1, rounds + 1):
        if options.quant_format != "qdq":
            # Ranking reads QuantizeLinear/DequantizeLinear pairs: it ranks a QDQ copy with the same excluded set.
            qdq_for_rank = attempt_dir / f"rank-{round_}.onnx"
            qdq = options.model_copy(update={"quant_format": "qdq"})
            quantize_int8(src, qdq_for_rank, feeds, scratch, qdq, exclude=list(chosen), preprocessed=pre)
        progress(f"int8 misses the {'accuracy or ' if accuracy else ''}parity bounds: ranking nodes (round {round_})")
        ranked: dict[str, float] = {}
        for node, loss, upstream in rank_sensitive_nodes(pre[0], qdq_for_rank, feeds[:RANK_SAMPLES], scratch):
            # A node already in float that still loses reads a tensor its int8 producers rounded.
            for name in [node] if node not in chosen else upstream:
                if name not in chosen and loss > 0:
                    ranked.setdefault(name, loss)
        if not ranked:
            report["stopped"] = "no quantised node left that loses signal"
            break
        take = max(1, math.ceil(len(graph_nodes) * FIRST_ROUND_SHARE * 2 ** (round_ - 1)))
        candidates = {
            f"the {take} nodes that lose most": {
                n: f"lost {loss} dB quantised" for n, loss in list(ranked.items())[:take]
            }
        }
        # What a node loses is often its output's rounding, which stays while its consumers are
        # int8 (a Conv into a decomposed HardSwish: Add, Clip, Mul, Div each round the tensor).
        # Leaving a whole op type in float removes every QDQ pair between such nodes; measured
        # on PP-OCRv4 rec, elementwise ops left in float moved SNR 4.9 -> 9.0 dB, Convs 4.9 -> -0.3.
        by_type: dict[str, float] = {}
        for n, loss in ranked.items():
            by_type[op_type.get(n, "?")] = by_type.get(op_type.get(n, "?"), 0.0) + loss
        # From the second round: a few nodes are the least a user would leave in float, so they go first.
        for t in sorted(by_type, key=lambda k: -by_type[k])[: OP_TYPE_CANDIDATES if round_ > 1 else 0]:
            candidates[f"every {t}"] = {
                n: f"op type {t} left in float" for n, o in op_type.items() if o == t and n not in chosen
            }
        tried_here: list[
            tuple[tuple[bool, bool, float, float], Path, dict[str, str], dict[str, object], dict[str, Any]]
        ] = []
        for label, extra in candidates.items():
            out = attempt_dir / f"round-{round_}-{len(tried_here)}.onnx"
            trial = {**chosen, **extra}
            attempt = quantize_int8(src, out, feeds, scratch, options, exclude=list(trial), preprocessed=pre)
            verdict = judge(out)
            attempts.append({"round": round_, "tried": label, "excluded": len(trial), **verdict})
            tried_here.append((_rank_key(verdict), out, trial, attempt, verdict))
            if verdict["passed"]:
                break
        key, out, trial, attempt, verdict = max(tried_here, key=lambda x: x[0])
        chosen = trial  # greedy: the round's best set, kept even when no better than before
        qdq_for_rank = out if options.quant_format == "qdq" else qdq_for_rank
        if key > best["key"]:
            best = {"key": key, "file": out, "chosen": dict(trial), "settings": attempt, "verdict": verdict}
        if key[0]:
            break
    if best["file"] is not None:
        shutil.copyfile(best["file"], dst)
        settings.update(best["settings"])
        if best["chosen"]:
            report["left_in_float"] = [{"node": n, "why": why} for n, why in best["chosen"].items()]
            report["ranked_by"] = (
                "SNR each node loses against fp32 once quantised (onnxruntime qdq_loss_debug activations)"
                + ("; each candidate set judged by the evaluation metric" if accuracy is not None else "")
            )
    report["kept"] = "the first attempt" if best["file"] is None else best["file"].stem
    report["reached"] = best["verdict"]
    return settings


def evaluation_judge(
    feeds: Sequence[dict[str, np.ndarray]], output: str, score_of: Callable[[list[np.ndarray]], dict[str, Any]]
) -> Judge:
    """Return a judge scoring a quantised ONNX file on the evaluation ``feeds`` by their ``output``.

    ``score_of`` turns the outputs into a verdict: ``metric``, ``score``, ``drop`` (against the
    source's score) and ``within_max_drop``.
    """

    def judge(path: Path) -> dict[str, Any]:
        return score_of([np.asarray(out[output]) for out in _run(path, feeds)])

    return judge
