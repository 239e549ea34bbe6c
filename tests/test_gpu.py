"""The GPU worker (queue kiln.gpu-cu13) and GPU-bound targets, on a machine without a GPU.

A target whose artifact runs on a GPU (onnxruntime with ``serving.onnxruntime_device: gpu``, tvm with
``options.tvm.cuda_arch``) gets a ``check:<target>`` step on the GPU engine's queue when a GPU worker
is live or the spec requires one; without, it is published with a "checked on the CPU only" warning
(manifest, job result, CLI summary). Here, NVML finds no driver: the GPU engine says why and no
worker serves it; the routing test stands a test double in for the GPU (NVML's answer and
onnxruntime's provider list) and nothing else. The tests that need a real GPU skip with the reason.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.errors import EngineUnavailable, InvalidSpec
from services.formats import Format
from services.gpu import device as gpu_device
from services.gpu.device import GpuDevice, device_versions, gpu_engine_unavailable
from services.graph.device_checks import device_bound, plans_device_checks
from services.graph.engines import ENGINES, installed_engines
from services.graph.planner import plan_routes
from services.pipeline import compile_model
from services.spec import load_spec

NO_GPU = gpu_engine_unavailable()
needs_gpu = pytest.mark.skipif(NO_GPU is not None, reason=f"needs a GPU worker's machine: {NO_GPU}")
no_gpu_here = pytest.mark.skipif(NO_GPU is None, reason="this machine has a GPU: the no-GPU behaviour is not seen")

GPU_ONNX = {"targets": ["onnxruntime"], "serving": {"onnxruntime_device": "gpu"}, "benchmark": False}
H100 = GpuDevice("NVIDIA H100 80GB HBM3", "9.0", 81559, "580.159.04", "13.0", "GPU-test-double")


def test_the_gpu_engine_is_a_cuda_variant_with_its_own_queue_and_image() -> None:
    from services.descriptors import concrete_engines
    from workers.queues import queue_engines, task_name

    assert ENGINES["gpu-cu13"].queue == "kiln.gpu-cu13" and "gpu-cu13" in queue_engines()
    assert task_name("gpu-cu13") == "kiln.step.gpu-cu13"
    image = concrete_engines()["gpu-cu13"].image
    assert (image.gpus, image.dockerfile, image.extras) == (1, "docker/gpu.Dockerfile", ("gpu", "service"))
    assert load_spec({"targets": ["onnxruntime"]}).options_for("gpu").variant == "cu13"  # type: ignore[union-attr]
    with pytest.raises(InvalidSpec, match="variant"):
        load_spec({"targets": ["onnxruntime"], "options": {"gpu": {"variant": "cu11"}}})


def test_which_targets_are_gpu_bound() -> None:
    assert device_bound("onnxruntime", load_spec(GPU_ONNX)) == (
        "onnxruntime's CUDA provider (serving.onnxruntime_device: gpu)"
    )
    assert device_bound("onnxruntime", load_spec({"targets": ["onnxruntime"]})) is None
    tvm = load_spec({"targets": ["tvm"], "options": {"tvm": {"cuda_arch": "sm_89"}}})
    assert device_bound("tvm", tvm) == "model_cuda.so for sm_89 (options.tvm.cuda_arch)"
    assert device_bound("tvm", load_spec({"targets": ["tvm"]})) is None
    assert device_bound("openvino", load_spec({"targets": ["openvino"]})) is None


def test_the_plan_checks_gpu_bound_targets_on_the_gpu_queue() -> None:
    spec = load_spec(
        {
            "targets": ["onnxruntime", "openvino", "tvm"],
            "serving": {"onnxruntime_device": "gpu"},
            "options": {"tvm": {"cuda_arch": "sm_90"}},
        }
    )
    plan = plan_routes(Format.ONNX, spec, gpu_worker=True)
    checks = {s.id: s for s in plan.steps if s.kind == "check"}
    assert set(checks) == {"check:onnxruntime", "check:tvm"}
    for target, check in ((t, checks[f"check:{t}"]) for t in ("onnxruntime", "tvm")):
        assert (check.engine, check.queue, check.entry) == ("gpu-cu13", "kiln.gpu-cu13", "check")
        assert check.inputs == {"model": f"export:{target}", "reference": "reference"}
        assert plan.step(f"publish:{target}").inputs["model"] == f"check:{target}"  # what is published was checked
    assert plan.step("publish:openvino").inputs["model"] == "export:openvino"
    # No GPU worker: no check step, the export is published (with its warning); unless the spec requires one.
    assert not [s for s in plan_routes(Format.ONNX, spec).steps if s.kind == "check"]
    required = spec.model_copy(update={"require_device_check": True})
    assert {s.id for s in plan_routes(Format.ONNX, required).steps if s.kind == "check"} == set(checks)
    # A target served on the CPU is never sent to the GPU worker.
    cpu = load_spec({"targets": ["onnxruntime"]})
    assert not [s for s in plan_routes(Format.ONNX, cpu, gpu_worker=True).steps if s.kind == "check"]


def test_require_device_check_is_a_scheduling_choice_not_part_of_a_cache_key() -> None:
    from services.pipeline.executor import _spec_fingerprint

    plain, required = load_spec(GPU_ONNX), load_spec({**GPU_ONNX, "require_device_check": True})
    assert plain.require_device_check is False and required.require_device_check is True
    assert _spec_fingerprint(plain, "export", None, "onnxruntime") == _spec_fingerprint(
        required, "export", None, "onnxruntime"
    )


@no_gpu_here
def test_without_a_gpu_the_gpu_engine_says_why_and_no_worker_serves_it() -> None:
    from workers.probe import resolve_engines, resolve_served

    assert NO_GPU is not None and ("NVIDIA driver" in NO_GPU or "nvidia-ml-py" in NO_GPU)
    assert "gpu-cu13" not in {e.name for e in installed_engines()}
    assert "gpu-cu13" not in resolve_served([])[1]
    with pytest.raises(EngineUnavailable, match=r"engine gpu-cu13 cannot run here: no NVIDIA driver") as err:
        resolve_engines(["gpu-cu13"])
    assert "worker-gpu-cu13" in err.value.hint
    assert device_versions() == {"gpu": "none"}
    assert plans_device_checks(load_spec(GPU_ONNX), {"onnxruntime"}) is False


@pytest.fixture
def gpu_double(monkeypatch: pytest.MonkeyPatch) -> GpuDevice:
    """A test double for the device alone: NVML reports an H100 and onnxruntime lists its CUDA provider."""
    import onnxruntime

    from services.versions import tool_versions

    monkeypatch.setattr(gpu_device, "probe_gpu", lambda: H100)
    monkeypatch.setattr(
        onnxruntime, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"]
    )
    gpu_device.gpu_engine_unavailable.cache_clear()
    tool_versions.cache_clear()
    yield H100
    gpu_device.gpu_engine_unavailable.cache_clear()
    tool_versions.cache_clear()


class _Broker:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send_task(self, name: str, **kwargs: Any) -> None:
        self.sent.append({"name": name, **kwargs})


def test_a_gpu_worker_takes_the_gpu_queue_and_the_check_is_routed_there(gpu_double: GpuDevice, tmp_path: Path) -> None:
    from services.jobs.migrate import upgrade
    from services.jobs.worker_registry import WorkerRegistry
    from workers.app import create_celery_app
    from workers.probe import engine_versions, resolve_served
    from workers.queues import enqueue_steps

    engines, queues = resolve_served(["gpu-cu13"])
    assert engines == queues == ["gpu-cu13"]
    assert "gpu-cu13" in {e.name for e in installed_engines()}  # a worker with no --engine serves it too
    versions = engine_versions(engines)
    assert GpuDevice.from_versions(versions["gpu-cu13"]) == GpuDevice(
        "NVIDIA H100 80GB HBM3", "9.0", 81559, "580.159.04", "13.0"
    )
    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    upgrade(url)
    registry = WorkerRegistry(url)
    registry.worker_heartbeat("gpu-box", engines=engines, versions=versions, pid=1, concurrency=1)
    live = {e for w in registry.live_workers(60) for e in w.engines}
    spec = load_spec(GPU_ONNX)
    assert plans_device_checks(spec, live) is True
    plan = plan_routes(Format.ONNX, spec, gpu_worker=plans_device_checks(spec, live))
    check = plan.step("check:onnxruntime")
    broker = _Broker()
    enqueue_steps(broker, "job-1", [(check.id, check.engine)])
    assert broker.sent == [
        {
            "name": "kiln.step.gpu-cu13",
            "args": ["job-1", "check:onnxruntime"],
            "queue": "kiln.gpu-cu13",
            "routing_key": "kiln.gpu-cu13",
            "retry": True,
            "retry_policy": broker.sent[0]["retry_policy"],
            "countdown": None,  # due now (a tenant over its share is deferred: workers/tasks.py)
        }
    ]
    # The worker app routes that task name to that queue (what a worker started with --engine gpu-cu13 consumes).
    app = create_celery_app()
    assert app.conf.task_routes["kiln.step.gpu-cu13"]["queue"] == "kiln.gpu-cu13"


def test_a_gpu_bound_target_without_a_gpu_worker_is_published_saying_it_was_checked_on_the_cpu(
    cnn_onnx: Path, store, repository, repo_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cli.summary import print_summary

    if NO_GPU is None:
        pytest.skip("this machine has a GPU: the in-process compile checks on it")
    result = compile_model(cnn_onnx, load_spec({**GPU_ONNX, "name": "ongpu"}), store=store, repository=repository)
    assert result.ok and not [s for s in result.plan.steps if s.kind == "check"]
    target = result.targets["onnxruntime"]
    (warning,) = target.warnings
    assert warning.startswith("checked on the CPU only: onnxruntime runs on a GPU through onnxruntime's CUDA provider")
    assert "kiln.gpu-cu13" in warning and "require_device_check" in warning
    assert target.device_check == {
        "checked_on": "cpu",
        "device_bound": "onnxruntime's CUDA provider (serving.onnxruntime_device: gpu)",
    }
    manifest = json.loads((repo_dir / "triton" / "ongpu" / "1" / "kiln-manifest.json").read_text())
    assert manifest["warnings"] == [warning] and manifest["device_check"] == target.device_check
    print_summary(result.job_id, [target.to_dict()])
    printed = " ".join(capsys.readouterr().out.split())
    assert "warning onnxruntime: checked on the CPU only" in printed
    # A target served on the CPU carries no such warning.
    plain = compile_model(cnn_onnx, load_spec({**GPU_ONNX, "serving": {}}), store=store, repository=repository)
    assert plain.targets["onnxruntime"].warnings == [] and plain.targets["onnxruntime"].device_check is None


@no_gpu_here
def test_require_device_check_without_a_gpu_fails_with_engine_unavailable(
    cnn_onnx: Path, store, repository, repo_dir: Path
) -> None:
    spec = load_spec({**GPU_ONNX, "require_device_check": True})
    result = compile_model(cnn_onnx, spec, store=store, repository=repository)
    target = result.targets["onnxruntime"]
    assert target.status == "failed" and target.error is not None
    assert target.error["code"] == "ENGINE_UNAVAILABLE"
    assert target.error["message"].startswith("onnxruntime must be checked on a GPU")
    assert target.error["details"]["step"] == "check:onnxruntime"
    assert not list(repo_dir.glob("triton/*/1"))  # nothing published unchecked


def test_the_summary_names_the_gpu_that_checked_a_target(capsys: pytest.CaptureFixture[str]) -> None:
    from cli.summary import device_check_line, print_warnings

    check = {
        "checked_on": "gpu",
        "device": H100.to_dict(),
        "runtime": "onnxruntime 1.31.1 CUDAExecutionProvider",
        "load_ms": 212.5,
        "parity": {"passed": True, "outputs": [{"name": "y", "snr_db": 131.2, "max_abs": 2e-6, "cosine": 1.0}]},
        "benchmark": [{"batch_size": 1, "p50_ms": 0.0412}],
    }
    line = device_check_line(check)
    assert line is not None and line.startswith(
        "checked on NVIDIA H100 80GB HBM3 (sm_90, 81559 MiB, driver 580.159.04, CUDA 13.0) with onnxruntime 1.31.1"
    )
    assert "p50 0.041 ms at batch 1" in line and line.endswith("loaded in 212.5 ms")
    assert device_check_line({"checked_on": "cpu"}) is None
    print_warnings([{"target": "onnxruntime", "device_check": check, "warnings": []}])
    assert "GPU onnxruntime: checked on NVIDIA H100" in " ".join(capsys.readouterr().out.split())


@needs_gpu
def test_on_a_gpu_the_check_runs_there_and_the_manifest_names_the_device(
    cnn_onnx: Path, store, repository, repo_dir: Path
) -> None:
    for precision in ("fp32", "fp16"):
        spec = load_spec({**GPU_ONNX, "name": f"gpu-{precision}", "precision": precision, "benchmark": True})
        result = compile_model(cnn_onnx, spec, store=store, repository=repository)
        target = result.targets["onnxruntime"]
        assert target.status == "succeeded", target.error
        check = target.device_check
        assert check is not None and check["checked_on"] == "gpu" and check["parity"]["passed"]
        assert check["runtime"].endswith("CUDAExecutionProvider") and check["benchmark"]
        assert check["device"]["arch"].startswith("sm_") and not any("CPU only" in w for w in target.warnings)
        manifest = json.loads((repo_dir / "triton" / f"gpu-{precision}" / "1" / "kiln-manifest.json").read_text())
        assert manifest["device_check"]["device"]["name"] == check["device"]["name"]
