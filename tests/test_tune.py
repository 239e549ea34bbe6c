"""`kiln tune`: real engines on tiny models built here; the search, its pruning, measurement, choice and profiles."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from jobs_support import KILN_CMD

from services.errors import InvalidSpec
from services.storage import LocalArtifactStore
from services.tune import TuneRequest, parse_budget, tune_model
from services.tune.profile import exec_precision
from services.tune.recommend import recommend
from services.tune.space import default_targets, settings_grid

#: fp32 artifacts agree with the source to well over 100 dB here, int8 ones to about 40-50 dB:
#: a 60 dB floor fails every int8 artifact and no fp32 one.
STRICT = {"tolerances": {"min_snr_db": 60}}


def run_kiln(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "220"}
    return subprocess.run([*KILN_CMD, *args], capture_output=True, text=True, timeout=600, env=env)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One artifact cache for the module: the builds of one test are the cache hits of the next."""
    return tmp_path_factory.mktemp("tune-cache")


@pytest.fixture(scope="module")
def cnn_report(cnn_onnx: Path, cache_dir: Path) -> dict[str, Any]:
    req = TuneRequest(
        model=cnn_onnx,
        targets=["onnxruntime", "openvino"],
        precisions=["fp32", "int8"],
        spec_data=STRICT,
        max_p99_ms=1000.0,
        rounds=15,
        warmup=2,
        profile_runs=5,
        race=False,  # every candidate in every round: the assertions below compare them all
    )
    report = tune_model(req, store=LocalArtifactStore(cache_dir / "store"))
    return {"report": report, "body": report.to_dict()}


def test_precision_failing_parity_is_pruned_and_never_timed(cnn_report: dict[str, Any]) -> None:
    body = cnn_report["body"]
    int8 = [c for c in body["candidates"] if c["precision"] == "int8"]
    # One untimed row per (target, int8): not expanded into the engine's settings.
    assert sorted(c["target"] for c in int8) == ["onnxruntime", "openvino"]
    for c in int8:
        assert c["status"] == "pruned" and not c["passed"]
        assert c["settings"] == {} and c["p50_ms"] is None and c["rounds"] == 0
        assert c["reason"].startswith("PARITY_FAILED")
        assert c["parity"]["min_snr_db"] < 60
    built = {(b["target"], b["precision"]): b["status"] for b in body["built"]}
    assert built == {
        ("onnxruntime", "fp32"): "built",
        ("openvino", "fp32"): "built",
        ("onnxruntime", "int8"): "pruned",
        ("openvino", "int8"): "pruned",
    }


def test_passing_precision_is_expanded_into_settings_and_timed_side_by_side(cnn_report: dict[str, Any]) -> None:
    body = cnn_report["body"]
    fp32 = [c for c in body["candidates"] if c["precision"] == "fp32"]
    for target in ("onnxruntime", "openvino"):
        rows = [c for c in fp32 if c["target"] == target]
        assert len(rows) == len(settings_grid(target, "latency")) >= 2
        assert len({json.dumps(c["settings"], sort_keys=True) for c in rows}) == len(rows)
    for c in fp32:
        assert c["status"] == "timed" and c["passed"]
        assert c["rounds"] == body["measurement"]["rounds"] == 15  # every candidate in every round
        assert 0 < c["p25_ms"] <= c["p50_ms"] <= c["p75_ms"] <= c["p99_ms"]
        assert c["p50_ci_ms"][0] <= c["p50_ms"] <= c["p50_ci_ms"][1]
        assert c["throughput"] > 0 and c["artifact"] and Path(c["artifact"]).exists()
    assert body["measurement"]["interleaved"] is True


def test_recommendation_is_fastest_or_within_noise_and_meets_the_slo(cnn_report: dict[str, Any]) -> None:
    body = cnn_report["body"]
    rec = body["recommendation"]
    assert rec["precision"] == "fp32" and rec["p99_ms"] <= body["max_p99_ms"]
    eligible = [c for c in body["candidates"] if c["meets_constraints"]]
    assert rec["eligible"] == len(eligible) == 7  # 4 onnxruntime + 3 openvino settings
    for c in eligible:
        if c["id"] != rec["id"]:
            assert rec["p50_ms"] <= c["p50_ms"] or c["id"] in rec["tied_within_noise"]
    ru = rec["runner_up"]
    assert ru is not None and ru["id"] != rec["id"]
    assert rec["margin"] == pytest.approx(ru["p50_ms"] / rec["p50_ms"] - 1, abs=1e-3)
    assert isinstance(rec["margin_within_noise"], bool)
    lo, _hi = rec["paired_difference"]["ci_ms"]
    assert rec["margin_within_noise"] == (lo <= 0)
    assert ("within the measured noise" in rec["verdict"]) == rec["margin_within_noise"]


def test_max_p99_excludes_slower_tails(cnn_report: dict[str, Any]) -> None:
    """With the SLO at the median p99 of the candidates, only those under it qualify; the pick is one of them."""
    report = cnn_report["report"]
    timed = [c for c in report.candidates if c.passed]
    p99s = sorted(c.p99_ms for c in timed)
    slo = p99s[len(p99s) // 2]
    rec = recommend(timed, "latency", slo)
    assert rec is not None and rec["p99_ms"] <= slo
    over = [c for c in timed if c.p99_ms > slo]
    assert over and all(not c.meets_constraints and c.violations for c in over)
    assert rec["id"] not in {c.key for c in over}
    assert recommend(timed, "latency", min(p99s) / 2) is None
    recommend(timed, "latency", None)  # leave the fixture's candidates unconstrained again


def test_cache_reuses_shared_conversions(cnn_report: dict[str, Any]) -> None:
    cache = cnn_report["body"]["cache"]
    # The int8 build reuses fp32's reference outputs, its ONNX optimisation and the IR conversion.
    assert {"int8:reference", "int8:optimize", "int8:optimize/onnx-to-openvino-ir"} <= set(cache["reused_steps"])
    assert cache["conversions_reused"] >= 3 and cache["steps_cached"] >= 3


def test_profiles_list_real_operators(cnn_report: dict[str, Any]) -> None:
    profiles = cnn_report["body"]["profiles"]
    by_engine = {p["target"]: p for p in profiles.values() if p.get("available")}
    assert set(by_engine) == {"onnxruntime", "openvino"}  # rec, runner-up, and the best of the other engine
    ort_ops = {op["op_type"] for op in by_engine["onnxruntime"]["top_ops"]}
    assert "Conv" in ort_ops
    ov = by_engine["openvino"]
    assert "Convolution" in {op["op_type"] for op in ov["top_ops"]}
    # fp32 under INFERENCE_PRECISION_HINT=f32: the layers with a precision ran in f32, none in bf16.
    assert ov["time_by_exec_precision"].get("f32", 0) > 0.5 and "bf16" not in ov["time_by_exec_precision"]
    for p in (by_engine["onnxruntime"], ov):
        shares = [op["share"] for op in p["top_ops"]]
        assert shares == sorted(shares, reverse=True) and sum(shares) <= 1.0 + 1e-9
    assert cnn_report["body"]["recommendation"]["profile"] == profiles["recommendation"]


def test_transformer_profile_shows_matmul(transformer_onnx: Path, cache_dir: Path) -> None:
    req = TuneRequest(
        model=transformer_onnx,
        targets=["onnxruntime", "openvino"],
        precisions=["fp32"],
        rounds=8,
        warmup=1,
        profile_runs=3,
    )
    body = tune_model(req, store=LocalArtifactStore(cache_dir / "store")).to_dict()
    ort = next(p for p in body["profiles"].values() if p["target"] == "onnxruntime" and p["available"])
    ort_ops = {op["op_type"] for op in ort["top_ops"]}
    assert ort_ops & {"MatMul", "FusedMatMul", "Attention", "MultiHeadAttention", "Gemm"}, ort_ops
    ov = next(p for p in body["profiles"].values() if p["target"] == "openvino" and p["available"])
    assert {op["op_type"] for op in ov["top_ops"]} & {"MatMul", "FullyConnected"}
    assert all(n["exec_precision"] in (None, "f32", "i8", "u8", "f16") for n in ov["top_nodes"])


def test_throughput_objective_picks_the_highest_throughput(cnn_onnx: Path, cache_dir: Path) -> None:
    req = TuneRequest(
        model=cnn_onnx,
        objective="throughput",
        batches=[1, 8],
        targets=["onnxruntime"],
        precisions=["fp32"],
        rounds=10,
        warmup=1,
        profile=False,
        concurrency_rounds=2,
        concurrency_round_s=0.005,
    )
    body = tune_model(req, store=LocalArtifactStore(cache_dir / "store")).to_dict()
    timed = [c for c in body["candidates"] if c["passed"]]
    assert {c["batch"] for c in timed} == {1, 8} and len(timed) == 2 * len(settings_grid("onnxruntime", "throughput"))
    rec = body["recommendation"]
    for c in timed:
        if c["id"] != rec["id"]:
            assert rec["throughput"] >= c["throughput"] or c["id"] in rec["tied_within_noise"]
    # The conversions come from the earlier tests' builds; only the export (other tolerances) runs again.
    assert body["cache"]["conversions_run"] == 0 and body["cache"]["conversions_reused"] >= 2


def test_size_objective_picks_the_smallest_artifact(cnn_onnx: Path, cache_dir: Path) -> None:
    req = TuneRequest(
        model=cnn_onnx,
        objective="size",
        targets=["onnxruntime", "openvino"],
        precisions=["fp32", "int8"],
        rounds=5,
        warmup=1,
        profile=False,
    )
    body = tune_model(req, store=LocalArtifactStore(cache_dir / "store")).to_dict()
    eligible = [c for c in body["candidates"] if c["meets_constraints"]]
    rec = body["recommendation"]
    assert rec["artifact_bytes"] == min(c["artifact_bytes"] for c in eligible)
    # Sizes are exact: the margin is noise only when the two artifacts are the same size.
    assert rec["margin_within_noise"] == (rec["runner_up"]["artifact_bytes"] == rec["artifact_bytes"])
    assert rec["margin"] == pytest.approx(rec["runner_up"]["artifact_bytes"] / rec["artifact_bytes"] - 1, abs=1e-3)
    assert body["measurement"]["racing"] is False  # size needs no race: every candidate is timed fully
    # No calibration data was given: the int8 builds say they were calibrated on generated samples.
    int8 = [c for c in eligible if c["precision"] == "int8"]
    assert int8 and all(any("calibrated on generated samples" in w for w in c["warnings"]) for c in int8)
    assert all(not c["warnings"] for c in eligible if c["precision"] == "fp32")


def test_cli_json_shape_table_and_publish(cnn_onnx: Path, cache_dir: Path, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    common = ["--precisions", "fp32", "--rounds", "8", "--warmup", "1", "--cache-dir", str(cache_dir)]
    proc = run_kiln("tune", str(cnn_onnx), "--targets", "onnxruntime,openvino,tflite", "--json", *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    body = json.loads(proc.stdout)
    assert set(body) >= {"candidates", "recommendation", "cache", "measurement", "profiles", "wall_s"}
    for c in body["candidates"]:
        assert set(c) >= {"target", "precision", "settings", "passed", "p50_ms", "p99_ms", "throughput", "artifact"}
        assert set(c) >= {"iqr_ms", "p50_ci_ms", "p25_ms", "p75_ms"}
    assert {c["target"] for c in body["candidates"] if c["passed"]} == {"onnxruntime", "openvino", "tflite"}
    tflite = {json.dumps(c["settings"], sort_keys=True) for c in body["candidates"] if c["target"] == "tflite"}
    assert any('"xnnpack": false' in s for s in tflite) and any('"xnnpack": true' in s for s in tflite)
    rec = body["recommendation"]
    assert set(rec) >= {"target", "precision", "settings", "p50_ms", "runner_up", "margin", "margin_within_noise"}

    proc = run_kiln(
        "tune", str(cnn_onnx), "--targets", "onnxruntime", "--profile", "--repo", str(repo), "--name", "cnn", *common
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    for column in ("target", "precision", "settings", "p50 ms", "IQR ms", "p99 ms"):
        assert column in proc.stdout, column
    assert "★ recommended" in proc.stdout and "recommendation: onnxruntime fp32" in proc.stdout
    assert "profile: recommendation" in proc.stdout and "Conv" in proc.stdout
    assert (repo / "triton" / "cnn" / "1" / "model.onnx").is_file()
    manifest = json.loads((repo / "triton" / "cnn" / "1" / "kiln-manifest.json").read_text())
    assert manifest["target"] == "onnxruntime" and manifest["precision"] == "fp32"
    tune = manifest["tune"]
    assert tune["chosen"]["target"] == "onnxruntime" and tune["chosen"]["settings"]["threads"] >= 1
    assert "Conv" in {op["op_type"] for op in tune["profiles"]["recommendation"]["top_ops"]}
    # The tune, written into the manifest after the publish, is signed with it: the version verifies.
    verified = run_kiln("verify", str(repo / "triton" / "cnn" / "1"), "--json")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert json.loads(verified.stdout)["signed_files"] == 2


def test_cli_refuses_and_fails_with_exit_statuses(cnn_onnx: Path, cache_dir: Path) -> None:
    bad = run_kiln("tune", str(cnn_onnx), "--targets", "nosuch", "--cache-dir", str(cache_dir))
    assert bad.returncode == 2 and "INVALID_SPEC" in bad.stderr and "Traceback" not in bad.stderr
    bad = run_kiln("tune", str(cnn_onnx), "--batch", "0", "--cache-dir", str(cache_dir))
    assert bad.returncode == 2 and "INVALID_SPEC" in bad.stderr
    bad = run_kiln("tune", str(cnn_onnx), "--budget", "soon", "--cache-dir", str(cache_dir))
    assert bad.returncode == 2 and "INVALID_SPEC" in bad.stderr and "10m" in bad.stderr
    common = ["--targets", "onnxruntime", "--precisions", "fp32", "--rounds", "5", "--warmup", "0"]
    # No artifact answers in a nanosecond: nothing qualifies, and the exit status says so.
    slo = run_kiln("tune", str(cnn_onnx), *common, "--max-p99-ms", "0.000001", "--cache-dir", str(cache_dir))
    assert slo.returncode == 1, slo.stderr[-2000:]
    assert "NO_CANDIDATE" in slo.stderr and "p99" in slo.stdout


def test_budget_spent_stops_early_and_says_so(cnn_onnx: Path, cache_dir: Path) -> None:
    req = TuneRequest(
        model=cnn_onnx, targets=["onnxruntime"], precisions=["fp32", "int8"], budget_s=1e-6, rounds=5, profile=False
    )
    body = tune_model(req, store=LocalArtifactStore(cache_dir / "store")).to_dict()
    assert body["stopped_early"] and "budget" in body["stopped_early"]
    assert body["recommendation"] is None
    assert {c["status"] for c in body["candidates"]} == {"skipped"}


def test_racing_drops_only_candidates_that_cannot_win(cnn_onnx: Path, cache_dir: Path) -> None:
    """LiteRT without XNNPACK is several times slower than with it: it leaves the race; the pick never does."""
    req = TuneRequest(
        model=cnn_onnx, targets=["onnxruntime", "tflite"], precisions=["fp32"], rounds=60, warmup=2, profile=False
    )
    body = tune_model(req, store=LocalArtifactStore(cache_dir / "store")).to_dict()
    timed = [c for c in body["candidates"] if c["passed"]]
    m = body["measurement"]
    assert m["racing"] is True and m["rounds"] == 60
    left = [c for c in timed if c["reason"] and c["reason"].startswith("left the race")]
    assert m["left_the_race"] == len(left) <= len(timed) - 2
    assert any(c["target"] == "tflite" and c["settings"]["xnnpack"] is False for c in left)
    rec = body["recommendation"]
    assert rec["rounds"] == 60 and rec["runner_up"]["rounds"] == 60
    for c in left:
        assert 20 <= c["rounds"] < 60 and c["id"] != rec["id"]
        # It left because its p50 was clearly worse than the pick's; the full-length rows did not.
        assert c["p50_ms"] > rec["p50_ms"]
    assert all(c["rounds"] == 60 for c in timed if c not in left)


def test_parse_budget_and_exec_precision() -> None:
    assert parse_budget("10m") == 600 and parse_budget("90s") == 90 and parse_budget("1.5h") == 5400
    assert parse_budget("45") == 45
    for bad in ("soon", "0m", "-1s"):
        with pytest.raises(InvalidSpec):
            parse_budget(bad)
    assert exec_precision("brgconv_avx512_amx_I8") == "i8"
    assert exec_precision("jit_avx512_FP32") == "f32"
    assert exec_precision("undef") is None
    assert set(default_targets()) <= {"onnxruntime", "openvino", "tflite"}


def test_throughput_objective_picks_batch_and_instances_from_measured_concurrency(
    cnn_onnx: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """Every batch × 1/2/4/8 instances is measured; the best point is served by the published Triton config."""
    from google.protobuf import text_format

    from services.repository import LocalModelRepository
    from services.repository.triton_config import model_config_pb2

    req = TuneRequest(
        model=cnn_onnx,
        objective="throughput",
        batches=[1, 4],
        targets=["onnxruntime"],
        precisions=["fp32"],
        rounds=6,
        warmup=1,
        profile=False,
        concurrency_rounds=3,
        concurrency_requests=4,
        concurrency_round_s=0.005,
        name="cnn",
    )
    repo = LocalModelRepository(tmp_path / "repo")
    body = tune_model(req, store=LocalArtifactStore(cache_dir / "store"), repository=repo).to_dict()
    rec = body["recommendation"]
    serving, curve = rec["serving"], rec["serving"]["curve"]
    assert curve["candidate"] == rec["id"] and curve["settings"] == rec["settings"]
    assert curve["concurrency"] == [1, 2, 4, 8] and curve["batches"] == [1, 4] and curve["rounds"] == 3
    assert set(curve["requests_per_instance"]) == {"1", "4"} and min(curve["requests_per_instance"].values()) >= 4
    points = curve["points"]
    assert [(p["batch"], p["instances"]) for p in points] == [(b, n) for b in (1, 4) for n in (1, 2, 4, 8)]
    for p in points:  # every point measured in every round, with its spread
        assert p["status"] == "measured" and p["rounds"] == 3 and p["reason"] is None
        lo, hi = p["throughput_ci"]
        assert 0 < lo <= p["throughput"] <= hi and p["p50_request_ms"] > 0
    best = max(p["throughput"] for p in points)
    pick = curve["pick"]
    assert pick in points and pick["throughput"] >= 0.9 * best  # the done-when: within 10% of the sweep's best
    assert pick["throughput"] == best and curve["pick_vs_best"] == 1.0  # the argmax itself
    assert curve["best_measured_throughput"] == best
    assert (serving["batch"], serving["instances"], serving["throughput"]) == (
        pick["batch"],
        pick["instances"],
        pick["throughput"],
    )
    for tied in curve["tied_within_noise"]:  # a tie's interval reaches the pick's
        other = next(p for p in points if (p["batch"], p["instances"]) == (tied["batch"], tied["instances"]))
        assert other["throughput_ci"][1] >= pick["throughput_ci"][0]

    # The published config serves the artifact as it was measured.
    text = (tmp_path / "repo" / "triton" / "cnn" / "config.pbtxt").read_text()
    cfg = text_format.Parse(text, model_config_pb2().ModelConfig())
    assert [g.count for g in cfg.instance_group] == [pick["instances"]]
    if pick["batch"] > 1:
        assert list(cfg.dynamic_batching.preferred_batch_size) == [pick["batch"]]
    else:
        assert list(cfg.dynamic_batching.preferred_batch_size) == []
    assert cfg.max_batch_size >= pick["batch"]
    assert cfg.parameters["intra_op_thread_count"].string_value == str(rec["settings"]["threads"])
    level = {"all": None, "basic": -1}[rec["settings"]["optimization"]]
    assert (cfg.optimization.graph.level if cfg.HasField("optimization") else None) == level
    # ... and its manifest holds the curve the pick came from, and the serving spec that wrote the config.
    manifest = json.loads((tmp_path / "repo" / "triton" / "cnn" / "1" / "kiln-manifest.json").read_text())
    assert manifest["tune"]["serving"]["curve"]["points"] == points
    assert manifest["tune"]["serving"]["curve"]["pick"] == pick
    assert manifest["spec"]["serving"]["triton"]["instance_count"] == pick["instances"]


def test_concurrency_curve_picks_only_measured_points(cnn_onnx: Path, tmp_path: Path) -> None:
    """A batch the artifact cannot run and levels never asked for are not picked; a spent budget still measures."""
    import onnx

    from services.spec import load_spec
    from services.tune.budget import Deadline
    from services.tune.concurrency import MIN_ROUNDS, measure_concurrency
    from services.tune.report import Candidate

    model = onnx.load(str(cnn_onnx))
    for value in (*model.graph.input, *model.graph.output):
        value.type.tensor_type.shape.dim[0].dim_value = 1  # the batch axis fixed at 1
    fixed = tmp_path / "fixed.onnx"
    onnx.save(model, str(fixed))
    c = Candidate("onnxruntime", "fp32", {"threads": 1}, 1, passed=True, status="timed", artifact=str(fixed))
    spec = load_spec({"targets": ["onnxruntime"]})
    common: dict[str, Any] = {"batches": [1, 4], "concurrency": (1, 2), "requests": 2, "warmup": 0, "min_round_s": 0}
    curve = measure_concurrency(c, "onnx", spec, deadline=Deadline(None), rounds=3, **common)
    by_point = {(p["batch"], p["instances"]): p for p in curve["points"]}
    assert set(by_point) == {(1, 1), (1, 2), (4, 1), (4, 2)}  # no level beyond those asked for
    for n in (1, 2):
        assert by_point[(4, n)]["status"] == "skipped" and by_point[(4, n)]["throughput"] is None
        assert "batch axis is fixed" in by_point[(4, n)]["reason"]
        assert by_point[(1, n)]["status"] == "measured" and by_point[(1, n)]["rounds"] == 3
    assert curve["pick"]["batch"] == 1 and curve["pick"]["status"] == "measured"
    assert curve["best_measured_throughput"] == max(by_point[(1, n)]["throughput"] for n in (1, 2))
    assert curve["requests_per_instance"] == {"1": 2}  # no round length asked: the floor of 2 requests

    spent = measure_concurrency(c, "onnx", spec, deadline=Deadline(1e-9), rounds=5, **common)
    assert spent["rounds"] == MIN_ROUNDS
    for p in spent["points"]:
        if p["batch"] == 1:
            assert p["rounds"] == MIN_ROUNDS and p["reason"].startswith("budget spent")


def test_cli_throughput_prints_the_curve_and_the_pick(cnn_onnx: Path, cache_dir: Path) -> None:
    common = ["--targets", "onnxruntime", "--precisions", "fp32", "--rounds", "5", "--warmup", "1"]
    args = ["tune", str(cnn_onnx), "--objective", "throughput", "--batch", "1,4", "--concurrency", "1,2", *common]
    proc = run_kiln(*args, "--cache-dir", str(cache_dir), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    curve = json.loads(proc.stdout)["recommendation"]["serving"]["curve"]
    assert curve["concurrency"] == [1, 2] and len(curve["points"]) == 4
    proc = run_kiln(*args, "--cache-dir", str(cache_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "throughput vs concurrency" in proc.stdout and "2 inst." in proc.stdout and "★" in proc.stdout
    assert "pick/best measured = 1.000" in proc.stdout and "serving: batch" in proc.stdout
    assert "throughput of onnxruntime/fp32" in proc.stderr  # the progress line
    bad = run_kiln("tune", str(cnn_onnx), "--objective", "throughput", "--concurrency", "0", *common)
    assert bad.returncode == 2 and "INVALID_SPEC" in bad.stderr and "--concurrency" in bad.stderr
