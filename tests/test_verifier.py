"""The verifier cannot be fooled: adversarial artifacts are refused at every precision (POST /compile: test_service_e2e).

Each adversary is built here (tests/verifier_support.py): an output scaled x2, shifted by one
standard deviation, replaced by a constant map, one sample zeroed among 64, a graph that
ignores its attention mask (only padded masks show it), informative activations rounded to
zero by int8 (real quantisation, no sabotage), a source that gives only NaN. The saboteur is
the real onnxruntime export of a graph it broke, checked by the real parity step; the
verdicts come from Kiln's own gate at its default bounds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import verifier_support as vs

from services.pipeline import compile_model
from services.spec import DEFAULT_TOLERANCES, Precision, load_spec
from services.validation import check_parity, compare_outputs

PRECISIONS = ["fp32", "fp16", "int8"]


@pytest.fixture
def saboteur(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Plans made in this process (compile_model, `kiln compile`) route onnxruntime through the saboteur."""
    import services.graph.registry as registry_module

    reg = vs.saboteur_registry()
    monkeypatch.setattr(registry_module, "_DEFAULT", reg)
    return reg


def _spec(kind: str, precision: str, **extra: Any) -> Any:
    return load_spec(
        {"targets": ["onnxruntime"], "precision": precision, "name": f"sabotage-{kind}", "benchmark": False, **extra}
    )


def _calibration(path: Path, rows: int, shape: tuple[int, ...], *, mark: bool = False) -> Path:
    data = {"x": np.random.default_rng(5).standard_normal((rows, *shape)).astype(np.float32)}
    if mark:
        vs.mark_one_sample(data)
    np.savez(path, **data)
    return path


# ------------------------------------------------------------------ the metrics alone


def test_the_issues_int8_map_is_refused_though_its_cosine_is_0_9994() -> None:
    # An output dominated by a large bias: a constant map plus noise has an uncentred cosine
    # near 1 and no correlation at all with the source.
    rng = np.random.default_rng(0)
    ref = [50.0 + rng.standard_normal((1, 4, 8, 8)) for _ in range(8)]
    act = [50.0 + 0.3 * rng.standard_normal((1, 4, 8, 8)) for _ in range(8)]
    tol = DEFAULT_TOLERANCES[Precision.INT8]
    out = compare_outputs("map", act, ref, tol)
    assert out.cosine > 0.999  # what fooled the old gate
    assert abs(out.pearson or 0.0) < 0.2 and (out.snr_db or 0.0) < 1.0
    assert out.class_axis == 1 and out.top1 is not None and out.top1 < 0.5  # per pixel, 4 classes
    report = check_parity(
        [{"map": a} for a in act], [{"map": r} for r in ref], tol, inputs_from="t", raise_on_failure=False
    )
    assert not report.passed and any("Pearson" in f for f in report.failures)


def test_a_source_varying_within_its_own_rounding_is_judged_by_allclose_not_snr() -> None:
    """Random-weight EfficientNetB0's softmax rows are 1e-3 +- 1.2e-9 in float32, about ten ULPs:
    a correct fp32 artifact's rounding alone scored SNR 3.5 dB. No artifact can meet 40 dB there,
    so such samples are judged by atol/rtol, cosine and top-1, and counted; a scaled artifact
    still fails, and a source that varies well above its rounding keeps every centred measure."""
    rng = np.random.default_rng(4)
    ref = [(1e-3 + 1.2e-9 * rng.standard_normal((1, 1000))).astype(np.float32) for _ in range(4)]
    ulp = np.spacing(np.float32(1e-3))
    rounded = [(r + ulp * rng.integers(-3, 4, r.shape)).astype(np.float32) for r in ref]
    tol = DEFAULT_TOLERANCES[Precision.FP32]
    out = compare_outputs("predictions", rounded, ref, tol)
    assert out.rounding_level == 4 and out.snr_db is None and out.pearson is None
    report = check_parity(
        [{"p": a} for a in rounded], [{"p": r} for r in ref], tol, inputs_from="t", raise_on_failure=False
    )
    assert report.passed, report.failures
    doubled = check_parity(
        [{"p": 2 * r} for r in ref], [{"p": r} for r in ref], tol, inputs_from="t", raise_on_failure=False
    )
    assert not doubled.passed and any("max_abs" in f for f in doubled.failures), doubled.failures
    wide = [(1e-3 + 1e-5 * rng.standard_normal((1, 1000))).astype(np.float32) for _ in range(4)]
    noisy = [(w + 3e-6 * rng.standard_normal(w.shape)).astype(np.float32) for w in wide]  # ~10 dB
    judged = compare_outputs("predictions", noisy, wide, tol)
    assert judged.rounding_level == 0 and judged.snr_db is not None and judged.snr_db < tol.min_snr_db


@pytest.mark.parametrize("precision", PRECISIONS)
def test_scale_and_bias_fail_at_every_precision(precision: str) -> None:
    rng = np.random.default_rng(1)
    ref = [rng.standard_normal((1, 32)) for _ in range(8)]
    tol = DEFAULT_TOLERANCES[Precision(precision)]
    for broken in ([2 * r for r in ref], [r + r.std() for r in ref]):
        report = check_parity(
            [{"y": b} for b in broken], [{"y": r} for r in ref], tol, inputs_from="t", raise_on_failure=False
        )
        assert not report.passed and any("SNR" in f for f in report.failures), report.failures


def test_top1_runs_per_position_for_sequence_logits_and_ignores_source_ties() -> None:
    rng = np.random.default_rng(2)
    ref = rng.standard_normal((2, 6, 50))
    ref[np.arange(2)[:, None], np.arange(6)[None, :], rng.integers(0, 50, (2, 6))] += (
        8.0  # confident, as trained logits are
    )
    flipped = ref.copy()
    flipped[0, 2] = ref[0, 2][::-1]  # one position's ranking reversed
    out = compare_outputs("logits", [flipped], [ref], DEFAULT_TOLERANCES[Precision.INT8])
    assert out.class_axis == 2 and out.top1_positions == 12 and out.top1 == pytest.approx(11 / 12)
    tie = np.zeros((1, 3, 5))
    tie[..., :2] = 1.0  # classes 0 and 1 tie everywhere: no position's answer is clear
    out = compare_outputs("logits", [tie[..., ::-1].copy()], [tie], DEFAULT_TOLERANCES[Precision.FP32])
    assert out.top1 is None and out.top1_positions == 0


def test_the_class_axis_can_be_set_per_output(tmp_path: Path, store, repository) -> None:
    model = vs.conv_net(tmp_path / "net.onnx")
    spec = load_spec(
        {"targets": ["onnxruntime"], "name": "axes", "benchmark": False, "validation": {"class_axis": {"y": None}}}
    )
    result = compile_model(model, spec, store=store, repository=repository)
    out = result.targets["onnxruntime"].parity["outputs"][0]
    assert out["class_axis"] is None and out["top1"] is None
    bad = load_spec({"targets": ["onnxruntime"], "name": "axes", "validation": {"class_axis": {"nope": 1}}})
    failed = compile_model(model, bad, store=store, repository=repository).targets["onnxruntime"]
    assert failed.error["code"] == "INVALID_SPEC" and "nope" in failed.error["message"]


# ------------------------------------------------------------------ through compile_model


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("kind", ["scale", "bias", "constant"])
@pytest.mark.parametrize("build", [vs.conv_net, vs.large_logits], ids=["unit-scale", "logits-1e3"])
def test_a_broken_artifact_is_refused_at_every_precision(
    build: Any, kind: str, precision: str, saboteur: Any, tmp_path: Path, store, repository, repo_dir: Path
) -> None:
    """Also on outputs reaching ~1e3, where the elementwise atol is scaled by the peak: the centred measures refuse."""
    model = build(tmp_path / "net.onnx")
    target = compile_model(model, _spec(kind, precision), store=store, repository=repository).targets["onnxruntime"]
    assert target.status == "failed" and target.error["code"] == "PARITY_FAILED", target.error
    parity = target.error["details"]["parity"]
    tol = DEFAULT_TOLERANCES[Precision(precision)]
    for out in parity["outputs"]:
        assert out["snr_db"] < tol.min_snr_db  # the numbers are in the error
        if kind == "constant" and out["pearson"] is not None:  # constant per sample: only sample means correlate
            assert abs(out["pearson"]) < 0.2
    assert target.published is None and not (repo_dir / "triton" / f"sabotage-{kind}").exists()


@pytest.mark.parametrize(
    ("target_name", "precision"),
    [("onnxruntime", "fp32"), ("onnxruntime", "fp16"), ("openvino", "fp32"), ("openvino", "fp16")],
)
def test_logits_near_1e3_publish_at_fp32_and_fp16_within_rounding_level_error(
    target_name: str, precision: str, tmp_path: Path, store, repository
) -> None:
    """Logits of ~3000 and class scores of ~1000: fp16 rounds them 0.5 apart, OpenVINO's fp32 kernels by 1e-3;
    the unscaled atol (2e-2, 1e-4) refused both though every centred measure is at rounding level."""
    model = vs.large_logits(tmp_path / "logits.onnx")
    spec = load_spec({"targets": [target_name], "precision": precision, "name": "logits", "benchmark": False})
    target = compile_model(model, spec, store=store, repository=repository).targets[target_name]
    assert target.status == "succeeded", target.error
    tol = DEFAULT_TOLERANCES[Precision(precision)]
    outs = {o["name"]: o for o in target.parity["outputs"]}
    assert max(abs(o["pearson"] or 1.0) for o in outs.values()) <= 1.0
    for o in outs.values():
        assert o["snr_db"] >= 60.0 and o["atol_used"] > 100 * tol.atol  # rounding level; atol scaled by the peak
    if (target_name, precision) != ("onnxruntime", "fp32"):  # onnxruntime's fp32 artifact is the source
        assert outs["y"]["max_abs"] > tol.atol + tol.rtol * 0.1  # what the unscaled bound refused


def test_a_localised_error_on_a_large_output_still_fails_the_elementwise_bound() -> None:
    """What atol is for: one value off by 1% of the peak hides from SNR and Pearson (diluted over the
    output), and still fails the peak-scaled atol at fp32 and fp16."""
    rng = np.random.default_rng(3)
    ref = [1000.0 * rng.standard_normal((1, 4, 16, 16)) for _ in range(8)]
    for precision in ("fp32", "fp16"):
        tol = DEFAULT_TOLERANCES[Precision(precision)]
        peak = max(float(np.abs(r).max()) for r in ref)
        act = [r.copy() for r in ref]
        act[5].reshape(-1)[17] += (2 * tol.atol) * peak + tol.rtol * abs(act[5].reshape(-1)[17])
        out = compare_outputs("y", act, ref, tol)
        assert out.snr_db is not None and out.snr_db > tol.min_snr_db  # the centred measures cannot see it
        report = check_parity(
            [{"y": a} for a in act], [{"y": r} for r in ref], tol, inputs_from="t", raise_on_failure=False
        )
        assert not report.passed and any("max_abs" in f and "peak" in f for f in report.failures), report.failures


@pytest.mark.parametrize("precision", PRECISIONS)
def test_one_zeroed_sample_among_64_is_refused(
    precision: str, saboteur: Any, tmp_path: Path, store, repository
) -> None:
    model = vs.conv_net(tmp_path / "net.onnx")
    calib = _calibration(tmp_path / "calib.npz", 256, (3, 16, 16), mark=True)  # 64 rows held out for parity
    spec = _spec("zero-one-sample", precision, calibration=str(calib))
    target = compile_model(model, spec, store=store, repository=repository).targets["onnxruntime"]
    assert target.status == "failed" and target.error["code"] == "PARITY_FAILED"
    parity = target.error["details"]["parity"]
    out = parity["outputs"][0]
    assert parity["samples_per_shape"][0] == 64
    assert out["worst_sample"] == 10 and out["cosine"] == pytest.approx(0.0, abs=1e-6)  # the marked row
    assert "worst sample 10" in target.error["message"]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_masking_bug_only_padded_masks_reveal_is_refused(
    precision: str, saboteur: Any, tmp_path: Path, store, repository
) -> None:
    model = vs.masked_mean(tmp_path / "mean.onnx")
    target = compile_model(model, _spec("ignore-mask", precision), store=store, repository=repository).targets[
        "onnxruntime"
    ]
    assert target.status == "failed" and target.error["code"] == "PARITY_FAILED"
    parity = target.error["details"]["parity"]
    assert "padded" in parity["input_provenance"]["attention_mask"]
    # The same broken graph on all-ones masks (what generated inputs used to be) is exact.
    import onnxruntime as ort

    broken = vs.sabotage(__import__("onnx").load(str(model)), "ignore-mask", {})
    session = ort.InferenceSession(broken.SerializeToString(), providers=["CPUExecutionProvider"])
    source = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    feed = {
        "x": np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32),
        "attention_mask": np.ones((2, 16), np.int64),
    }
    np.testing.assert_array_equal(session.run(None, feed)[0], source.run(None, feed)[0])


@pytest.mark.parametrize("target_name", ["onnxruntime", "openvino"])
def test_int8_that_rounds_informative_activations_to_zero_is_refused(
    target_name: str, tmp_path: Path, store, repository
) -> None:
    model = vs.activation_outliers(tmp_path / "outliers.onnx")
    data: dict[str, Any] = {"targets": [target_name], "precision": "int8", "name": "outliers", "benchmark": False}
    if target_name == "onnxruntime":
        # The destroyed artifact itself: onnxruntime's exclusion fallback (below) would repair it.
        data["options"] = {"onnxruntime": {"int8": {"auto_exclude": False}}}
    target = compile_model(model, load_spec(data), store=store, repository=repository).targets[target_name]
    assert target.status == "failed" and target.error["code"] == "PARITY_FAILED", target.parity
    out = target.error["details"]["parity"]["outputs"][0]
    assert out["cosine"] > 0.98  # the old gate (uncentred cosine >= 0.98) published this
    assert out["pearson"] < DEFAULT_TOLERANCES[Precision.INT8].min_pearson
    # fp32 of the same model is sound: the failure is int8's, not the model's.
    fp32 = load_spec({"targets": [target_name], "precision": "fp32", "name": "outliers", "benchmark": False})
    assert compile_model(model, fp32, store=store, repository=repository).targets[target_name].status == "succeeded"
    if target_name == "onnxruntime":
        # At the defaults the sensitive nodes stay in float and what is published passes the same gate.
        default = load_spec({k: v for k, v in data.items() if k != "options"})
        repaired = compile_model(model, default, store=store, repository=repository).targets[target_name]
        assert repaired.status == "succeeded", repaired.error
        out = repaired.parity["outputs"][0]
        assert out["pearson"] >= DEFAULT_TOLERANCES[Precision.INT8].min_pearson, out


def test_a_source_that_gives_only_nan_is_refused_with_a_code_and_a_hint(tmp_path: Path, store, repository) -> None:
    model = vs.all_nan(tmp_path / "nan.onnx")
    spec = load_spec({"targets": ["onnxruntime"], "name": "nan", "benchmark": False})
    target = compile_model(model, spec, store=store, repository=repository).targets["onnxruntime"]
    assert target.error["code"] == "SOURCE_NONFINITE"
    assert "no finite outputs" in target.error["message"] and "calibration" in target.error["hint"]


# ------------------------------------------------------------------ where it went wrong


def test_the_first_divergent_node_is_named(saboteur: Any, tmp_path: Path, store, repository) -> None:
    model = vs.conv_net(tmp_path / "net.onnx")
    target = compile_model(model, _spec("break-node", "fp32"), store=store, repository=repository).targets[
        "onnxruntime"
    ]
    assert target.error["code"] == "PARITY_FAILED"
    loc = target.error["details"]["parity"]["localization"]
    assert loc["node"] == "conv2" and loc["op_type"] == "Conv" and loc["snr_db"] < 40
    assert "first divergent node: conv2 (Conv)" in target.error["message"]


def test_localisation_names_the_broken_node_of_an_openvino_ir(tmp_path: Path) -> None:
    import onnx
    import openvino as ov

    from services.formats import Format
    from services.validation.localize import localize_divergence

    model = vs.conv_net(tmp_path / "net.onnx")
    broken = vs.sabotage(onnx.load(str(model)), "break-node", {})
    onnx.save(broken, str(tmp_path / "broken.onnx"))
    ov.save_model(ov.convert_model(str(tmp_path / "broken.onnx")), str(tmp_path / "broken.xml"))
    feed = {"x": np.random.default_rng(0).standard_normal((1, 3, 16, 16)).astype(np.float32)}
    loc = localize_divergence(
        model, tmp_path / "broken.xml", Format.OPENVINO_IR, feed, DEFAULT_TOLERANCES[Precision.FP32]
    )
    assert loc["node"] == "conv2" and loc["compared"] >= 2
    sound = localize_divergence(model, model, Format.ONNX, feed, DEFAULT_TOLERANCES[Precision.FP32])
    assert sound["node"] is None and sound["compared"] >= 5


# ------------------------------------------------------------------ through the CLI and the API


def test_kiln_compile_refuses_a_broken_artifact_with_the_numbers(saboteur: Any, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from cli.main import main as cli

    model = vs.conv_net(tmp_path / "net.onnx")
    args = ["compile", str(model), "-t", "onnxruntime", "--name", "sabotage-scale", "--repo", str(tmp_path / "repo")]
    args += ["--cache-dir", str(tmp_path / "cache"), "--json"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1, result.output
    body = json.loads(result.stdout)
    target = body["targets"]["onnxruntime"]
    assert target["error"]["code"] == "PARITY_FAILED" and "SNR" in target["error"]["message"]


def test_kiln_compile_exits_2_for_a_source_without_finite_outputs(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from cli.main import main as cli

    model = vs.all_nan(tmp_path / "nan.onnx")
    args = [
        "compile",
        str(model),
        "-t",
        "onnxruntime",
        "--repo",
        str(tmp_path / "repo"),
        "--cache-dir",
        str(tmp_path / "c"),
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and "SOURCE_NONFINITE" in result.output, result.output
