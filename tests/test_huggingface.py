"""Hugging Face checkpoint directories (config.json + safetensors) compiled for onnxruntime and
OpenVINO, with the reference computed by the transformers model itself; what must never be
read (pickles, custom code, paths outside the directory) refused before transformers runs.

Checkpoints are built here from tiny configs (2 layers, hidden 32) with random weights and
saved with ``save_pretrained``; nothing is downloaded.
"""

from __future__ import annotations

import functools
import io
import json
import pickle
import subprocess
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from engine_contract import BATCH, RunnerContract
from jobs_support import KILN_CMD, Proc, free_port, service_env, submit, wait_http, wait_job, wait_workers

from kiln_testing.models import assert_parity_passed
from services.descriptors.huggingface import HuggingFaceOptions
from services.errors import SourceUnreadable, UnsafeInput, UnsupportedFormat
from services.formats import Format, detect_format, open_source
from services.pipeline import compile_model
from services.runners import open_runner
from services.spec import load_spec

pytest.importorskip("transformers")

VOCAB = 64


def _save(model: object, path: Path, **kwargs: object) -> Path:
    model.save_pretrained(str(path), **kwargs)  # type: ignore[attr-defined]
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hf")


@pytest.fixture(scope="module")
def checkpoints(hf_dir: Path) -> dict[str, Path]:
    """BERT (sequence classification), GPT-2 (causal LM, sharded), ViT (image classification), T5 encoder."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    bert = tf.BertForSequenceClassification(
        tf.BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=64,
            num_labels=3,
        )
    )
    gpt2 = tf.GPT2LMHeadModel(
        tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64, bos_token_id=0, eos_token_id=0)
    )
    vit = tf.ViTForImageClassification(
        tf.ViTConfig(
            image_size=16,
            patch_size=8,
            num_channels=3,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            num_labels=4,
        )
    )
    t5 = tf.T5EncoderModel(
        tf.T5Config(vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, decoder_start_token_id=0)
    )
    return {
        "bert": _save(bert, hf_dir / "bert"),
        # Small shards: config.json + model.safetensors.index.json + model-0000x-of-0000y.safetensors.
        "gpt2": _save(gpt2, hf_dir / "gpt2", max_shard_size="20KB"),
        "vit": _save(vit, hf_dir / "vit"),
        "t5": _save(t5, hf_dir / "t5"),
    }


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from services.storage import LocalArtifactStore

    return LocalArtifactStore(tmp_path_factory.mktemp("hf-store"))


def _spec(targets: list[str], **extra: object):  # type: ignore[no-untyped-def]
    body = {"targets": targets, "name": "m", "benchmark": False, "validation": {"samples": 4}, **extra}
    return load_spec(body)


def _onnx_dims(path: Path) -> dict[str, list[object]]:
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    return {
        vi.name: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]
        for vi in [*graph.input, *graph.output]
    }


# --------------------------------------------------------------------------- detection


def test_checkpoints_are_detected_from_content_as_folders_and_archives(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    for path in checkpoints.values():
        assert detect_format(path)[0] is Format.HUGGINGFACE
    src = checkpoints["gpt2"]
    assert (src / "model.safetensors.index.json").exists() and len(list(src.glob("*.safetensors"))) >= 2
    with zipfile.ZipFile(tmp_path / "gpt2.zip", "w") as zf:
        for f in src.iterdir():
            zf.write(f, f"gpt2/{f.name}")  # one folder inside the archive, as zipping a directory gives
    with tarfile.open(tmp_path / "gpt2.tar.gz", "w:gz") as tf:
        tf.add(src, "gpt2")
    for archive in (tmp_path / "gpt2.zip", tmp_path / "gpt2.tar.gz"):
        assert detect_format(archive)[0] is Format.HUGGINGFACE
        source = open_source(archive, tmp_path / archive.name.split(".")[0])
        assert source.format is Format.HUGGINGFACE and (source.path / "config.json").exists()
    # optimum-intel writes config.json beside an OpenVINO IR: still an IR, not a checkpoint.
    ir = tmp_path / "ir"
    ir.mkdir()
    (ir / "config.json").write_text("{}")
    (ir / "openvino_model.xml").write_text("<?xml version='1.0'?><net name='m'></net>")
    (ir / "openvino_model.bin").write_bytes(b"\0" * 8)
    assert detect_format(ir)[0] is Format.OPENVINO_IR


# --------------------------------------------------------------------------- the runner contract


class TestHuggingFaceRunner(RunnerContract):
    """The runner contract on the tiny ViT (pixel_values -> logits).

    A checkpoint is an architecture transformers ships, so it cannot hold the contract model
    (x, y -> z_sum, a_prod); the expected outputs are the transformers model's own, loaded
    with from_pretrained and run without Kiln.
    """

    fmt = "huggingface"
    output_names = ("logits",)
    tolerance = 1e-5

    @pytest.fixture
    def model(self, checkpoints: dict[str, Path]) -> Path:
        return checkpoints["vit"]

    def feeds(self, model: Path) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(0)
        return {"pixel_values": rng.standard_normal((BATCH, 3, 16, 16)).astype(np.float32)}

    def nonfinite(self, model: Path) -> dict[str, np.ndarray]:
        x = self.feeds(model)["pixel_values"]
        x[0, 0, 0, 0] = np.inf  # image 0: an infinite pixel; image 1: a NaN one; image 2 stays finite
        x[1, 2, 5, 5] = np.nan
        return {"pixel_values": x}

    def expected(self, model: Path, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        with torch.no_grad():
            logits = _transformers_vit(model)(pixel_values=torch.from_numpy(feeds["pixel_values"])).logits
        return {"logits": logits.numpy()}


@functools.cache
def _transformers_vit(path: Path) -> Any:
    """Return the checkpoint loaded by transformers alone (no vetting, no staging, no Kiln wrapper)."""
    import transformers as tf

    return tf.ViTForImageClassification.from_pretrained(str(path), attn_implementation="eager").eval()


# --------------------------------------------------------------------------- compile, 4 families


@pytest.mark.parametrize(
    ("family", "task", "inputs", "outputs"),
    [
        ("bert", None, {"input_ids", "attention_mask", "token_type_ids"}, {"logits": ["batch", 3]}),
        ("gpt2", None, {"input_ids", "attention_mask"}, {"logits": ["batch", "sequence", VOCAB]}),
        (
            "gpt2",
            "causal-lm-with-past",
            {"input_ids", *(f"past_key_values.{i}.{k}" for i in range(2) for k in ("key", "value"))},
            {"logits": ["batch", "sequence", VOCAB], "present.1.value": ["batch", 2, "past_sequence + sequence", 16]},
        ),
    ],
)
def test_each_family_compiles_for_onnxruntime_and_openvino_within_fp32_parity(
    checkpoints: dict[str, Path],
    store,  # type: ignore[no-untyped-def]
    tmp_path: Path,
    family: str,
    task: str | None,
    inputs: set[str],
    outputs: dict[str, list[object]],
) -> None:
    from services.repository import LocalModelRepository

    # One store for every case: GPT-2 with past must not reuse GPT-2's cached conversion or reference.
    extra = {"options": {"huggingface": {"task": task}}} if task else {}
    result = compile_model(
        checkpoints[family],
        _spec(["onnxruntime", "openvino"], **extra),
        store=store,
        repository=LocalModelRepository(tmp_path / "repo"),
    )
    for target in ("onnxruntime", "openvino"):
        r = result.targets[target]
        assert r.status == "succeeded", r.error
        assert r.route.startswith("huggingface → onnx"), r.route
        assert_parity_passed(r.parity, "fp32")  # type: ignore[arg-type]
    onnx_file = next((tmp_path / "repo").rglob("model.onnx"))
    dims = _onnx_dims(onnx_file)
    assert {n for n in dims if n not in outputs and not n.startswith("present")} == inputs
    if "pixel_values" in inputs:
        assert dims["pixel_values"] == ["batch", 3, 16, 16]
    else:
        assert dims["input_ids"] == ["batch", "sequence"]
    for name, want in outputs.items():
        assert dims[name] == want, (name, dims[name])
    if family == "bert":
        _bert_at_other_sizes(onnx_file, checkpoints["bert"])


def _bert_at_other_sizes(onnx_file: Path, checkpoint: Path) -> None:
    """Run the published graph at batch 1 and sequence 11 (the export used 2 and 7) against transformers."""
    import onnxruntime as ort
    import torch
    import transformers as tf

    ids = np.array([[5, 9, 3, 1, 7, 2, 8, 4, 6, 11, 12]], dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
    got = ort.InferenceSession(str(onnx_file)).run(["logits"], feeds)[0]
    model = tf.BertForSequenceClassification.from_pretrained(str(checkpoint))
    with torch.no_grad():
        want = model(**{k: torch.from_numpy(v) for k, v in feeds.items()}).logits.numpy()
    assert got.shape == (1, 3)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_the_task_is_in_every_steps_cache_key() -> None:
    """The shared-store case above depends on this: a task is a different reference, conversion and export."""
    from services.graph.planner import PlanStep
    from services.pipeline.executor import step_cache_key

    def keys(task: str | None) -> list[str]:
        spec = _spec(["onnxruntime", "openvino"], options={"huggingface": {"task": task}})
        steps = [
            PlanStep("reference", "reference", "onnxruntime", "m:ref", inputs={"model": "source"}),
            PlanStep("convert:hf", "convert", "onnxruntime", "m:conv", inputs={"model": "source"}),
            PlanStep("optimize", "optimize", "onnxruntime", "m:opt", inputs={"model": "convert:hf"}),
            PlanStep("export:ov", "export", "openvino", "m:exp", inputs={"model": "x"}, options={"precision": "fp32"}),
        ]
        return [step_cache_key(s, spec, {"model": "k"}) for s in steps]

    plain, with_past = keys("causal-lm"), keys("causal-lm-with-past")
    assert all(a != b for a, b in zip(plain, with_past, strict=True))
    assert keys("causal-lm") == plain


# --------------------------------------------------------------------------- safety


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


class _Marker:
    """Unpickling this creates a file: proof that a pickle was (not) loaded."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (open, (self.path, "w"))


def test_pickled_weights_are_refused_alone_and_never_read_beside_safetensors(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    marker = tmp_path / "unpickled"
    payload = pickle.dumps(_Marker(str(marker)))
    only_bin = tmp_path / "only-bin"
    only_bin.mkdir()
    (only_bin / "config.json").write_text((checkpoints["bert"] / "config.json").read_text())
    (only_bin / "pytorch_model.bin").write_bytes(payload)
    assert detect_format(only_bin)[0] is Format.HUGGINGFACE
    with pytest.raises(UnsafeInput, match="pickled weights"):
        open_source(only_bin, tmp_path / "w1")
    beside = _copy(checkpoints["bert"], tmp_path / "beside")
    (beside / "pytorch_model.bin").write_bytes(payload)
    (beside / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w')\n")
    runner = open_runner(Format.HUGGINGFACE, beside)
    assert runner.checkpoint.ignored == ("modeling_evil.py", "pytorch_model.bin")
    feeds = {t.name: np.ones([2, 5], dtype=np.int64) for t in runner.inputs}
    assert runner.run(feeds)["logits"].shape == (2, 3)
    assert not marker.exists()


def test_custom_code_is_refused_from_the_config_and_from_the_spec(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    custom = _copy(checkpoints["bert"], tmp_path / "custom")
    config = json.loads((custom / "config.json").read_text())
    config["auto_map"] = {"AutoModel": "modeling_evil.EvilModel"}
    (custom / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsafeInput, match="auto_map") as exc:
        open_source(custom, tmp_path / "w")
    assert exc.value.code == "UNSAFE_INPUT" and "trust_remote_code" in exc.value.hint
    # At any depth: a composite model's sub-config names code as well as its top level does.
    nested = _copy(checkpoints["bert"], tmp_path / "nested")
    config = json.loads((nested / "config.json").read_text())
    config["text_config"] = {"model_type": "bert", "sub": [{"auto_map": {"AutoModel": "modeling_evil.Evil"}}]}
    (nested / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsafeInput) as exc:
        open_source(nested, tmp_path / "w2")
    assert exc.value.details["key"] == "text_config.sub[0].auto_map"
    pipelines = _copy(checkpoints["bert"], tmp_path / "pipelines")
    (pipelines / "generation_config.json").write_text(json.dumps({"custom_pipelines": {"x": {"impl": "evil.Pipe"}}}))
    with pytest.raises(UnsafeInput, match="custom_pipelines"):
        open_source(pipelines, tmp_path / "w3")
    with pytest.raises(UnsafeInput, match="trust_remote_code"):
        load_spec({"targets": ["onnxruntime"], "options": {"huggingface": {"trust_remote_code": True}}})
    with pytest.raises(UnsafeInput):
        HuggingFaceOptions(trust_remote_code=True)


def test_paths_outside_the_checkpoint_are_refused(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    sharded = _copy(checkpoints["gpt2"], tmp_path / "sharded")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../outside.safetensors"
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UnsafeInput, match="outside the model directory"):
        open_source(sharded, tmp_path / "w1")
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "config.json").write_text((checkpoints["bert"] / "config.json").read_text())
    (linked / "model.safetensors").symlink_to(checkpoints["bert"] / "model.safetensors")
    with pytest.raises(UnsafeInput, match="resolves outside"):
        open_source(linked, tmp_path / "w2")
    evil = tmp_path / "evil.zip"
    with zipfile.ZipFile(evil, "w") as zf:
        zf.write(checkpoints["bert"] / "config.json", "m/config.json")
        zf.write(checkpoints["bert"] / "model.safetensors", "m/model.safetensors")
        zf.writestr("m/../../escaped.txt", "x")
    with pytest.raises(UnsafeInput, match=r"\.\."):
        open_source(evil, tmp_path / "w3")
    assert not (tmp_path / "escaped.txt").exists()


def test_broken_checkpoints_are_named(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    truncated = _copy(checkpoints["bert"], tmp_path / "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(SourceUnreadable, match="outside the file"):
        open_source(truncated, tmp_path / "w1")
    unknown = _copy(checkpoints["bert"], tmp_path / "unknown")
    config = json.loads((unknown / "config.json").read_text())
    config["model_type"] = "no-such-architecture"
    (unknown / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedFormat, match="no-such-architecture"):
        open_runner(Format.HUGGINGFACE, unknown)
    # The T5 encoder checkpoint has no LM head: compiling it for causal-lm would publish random weights.
    with pytest.raises((SourceUnreadable, UnsupportedFormat)):
        open_runner(Format.HUGGINGFACE, checkpoints["bert"], options=HuggingFaceOptions(task="causal-lm"))


# --------------------------------------------------------------------------- the command line and the service


def test_kiln_compile_publishes_a_checkpoint_directory(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text(
        json.dumps({"benchmark": {"batch_sizes": [1, 2], "iterations": 5, "warmup": 1}, "validation": {"samples": 4}})
    )
    proc = subprocess.run(
        [
            *KILN_CMD,
            *("compile", str(checkpoints["vit"]), "-t", "onnxruntime", "-t", "openvino", "--spec", str(spec)),
            *("--repo", str(tmp_path / "repo"), "--name", "vit", "--cache-dir", str(tmp_path / "cache"), "-q"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for target in ("onnxruntime", "openvino"):
        version = tmp_path / "repo" / "triton" / f"vit-{target}" / "1"
        manifest = json.loads((version / "kiln-manifest.json").read_text())
        assert manifest["source"]["format"] == "huggingface"
        assert manifest["route"].startswith("huggingface → onnx"), manifest["route"]
        assert_parity_passed(manifest["parity"], "fp32")
        assert [b["batch_size"] for b in manifest["benchmark"]] == [1, 2]
    assert {"transformers", "safetensors", "torch"} <= set(manifest["tool_versions"])
    dims = _onnx_dims(tmp_path / "repo" / "triton" / "vit-onnxruntime" / "1" / "model.onnx")
    assert dims == {"pixel_values": ["batch", 3, 16, 16], "logits": ["batch", 4]}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"options": {"huggingface": {"trust_remote_code": True}}}))
    refused = subprocess.run(
        [*KILN_CMD, "compile", str(checkpoints["vit"]), "--target", "onnxruntime", "--spec", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2 and "UNSAFE_INPUT" in refused.stdout + refused.stderr


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    root = tmp_path_factory.mktemp("hf-service")
    port = free_port()
    proc = Proc(
        ["serve", "--port", str(port), "--repo", str(root / "repo")],
        service_env(cache_dir=root / "cache"),
        root / "serve.log",
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{base}/healthz", proc=proc)
        wait_workers(base, {"onnxruntime", "openvino"}, procs=[proc])
        yield base, root
    finally:
        proc.stop()


def test_post_compile_takes_an_archived_checkpoint_and_refuses_an_escaping_one(
    service: tuple[str, Path], checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    base, root = service
    upload = tmp_path / "t5.tar.gz"
    with tarfile.open(upload, "w:gz") as tf:
        tf.add(checkpoints["t5"], "t5")
    spec = {"targets": ["onnxruntime", "openvino"], "name": "t5", "benchmark": False, "validation": {"samples": 4}}
    r = submit(base, upload, spec)
    assert r.status_code == 202, r.text
    job = wait_job(base, r.json()["id"], timeout=300)
    assert job["status"] == "succeeded", json.dumps(job)[:3000]
    assert job["source"]["format"] == "huggingface"
    for target in ("onnxruntime", "openvino"):
        assert_parity_passed(job["targets"][target]["parity"], "fp32")
    assert (root / "repo" / "triton" / "t5-openvino" / "1" / "model.xml").exists()
    dims = _onnx_dims(root / "repo" / "triton" / "t5-onnxruntime" / "1" / "model.onnx")
    assert dims == {
        "input_ids": ["batch", "sequence"],
        "attention_mask": ["batch", "sequence"],
        "last_hidden_state": ["batch", "sequence", 32],
    }
    evil = tmp_path / "evil.zip"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for f in checkpoints["t5"].iterdir():
            zf.write(f, f"t5/{f.name}")
        zf.writestr("../evil.txt", "x")
    evil.write_bytes(buf.getvalue())
    refused = submit(base, evil, spec)
    assert refused.status_code == 400 and refused.json()["code"] == "UNSAFE_INPUT", refused.text
    remote = submit(base, upload, {**spec, "options": {"huggingface": {"trust_remote_code": True}}})
    assert remote.status_code == 400 and remote.json()["code"] == "UNSAFE_INPUT", remote.text
    assert httpx.get(f"{base}/jobs", timeout=5).json()["count"] == 1
