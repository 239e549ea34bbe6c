"""Kiln's GPU artifacts on a real GPU: parity against the source, load time, latency against onnxruntime CPU.

Two halves, because the GPU machine it is written for (the device tool's: Python 3.12 with torch,
CUDA 13 libraries and cuda-bindings, a CPU-only onnxruntime, no network, at most 64 MiB carried):

    # 1. here, on a CPU machine with Kiln's venv (and PyPI): build and pack, about 3 MB
    .venv/bin/python benchmarks/gpu_check.py build --out gpucheck --arch sm_90
    # 2. there, from the repository root, with `gpucheck` carried (it is git-ignored):
    python3 benchmarks/gpu_check.py run --carry gpucheck --out "$OUT"

``build`` compiles a tiny CNN and a small ResNet with Kiln's tvm target (``options.tvm.cuda_arch``:
the kernels an embedded cubin), writes the fp32 and fp16 ONNX Kiln's onnxruntime target exports,
the inputs and the source's outputs (onnxruntime CPU on the fp32 model), and a runtime-only TVM:
the ``tvm`` package without its 259 MB compiler library and ``apache-tvm-ffi``'s wheel for the GPU
machine's Python, packed as ``gpucheck/tvm-runtime.tar.xz``. ``run`` imports nothing of Kiln:
``TVM_USE_RUNTIME_LIB=1`` with ``tvm.runtime`` alone, TVM's CUDA runtime library loaded by hand,
each model_cuda.so loaded and timed (load_module + VM + weights on the GPU), checked against the
source (SNR dB, max abs) and timed at batch 4 against the same model on onnxruntime's CPU provider;
onnxruntime's CUDA provider too, where the machine's onnxruntime has it (else the row says so).
It prints a markdown table (and writes ``gpu_check.md`` and ``gpu_check.json`` under ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODELS = ("cnn", "resnet")
BATCH = 4


# --- build (CPU machine, Kiln's venv) ------------------------------------------------------------


def _resnet_onnx(path: Path) -> Path:
    import torch

    sys.path.insert(0, str(ROOT))
    from kiln_testing.models import resnetish_module

    module = resnetish_module().eval()
    torch.onnx.export(
        module,
        (torch.randn(1, 3, 32, 32),),
        str(path),
        input_names=["input"],
        output_names=["output"],
        dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}},
        dynamo=False,
    )
    # nn.Sequential names its weights "12.bias": TVM's CUDA codegen turns them into kernel parameters
    # named 12_bias_ptr, which no C compiler takes (Kiln's own tvm target has the same limit today).
    import onnx

    model = onnx.load(str(path))
    renamed = {i.name: f"w_{i.name}" for i in model.graph.initializer if i.name[:1].isdigit()}
    for init in model.graph.initializer:
        init.name = renamed.get(init.name, init.name)
    for node in model.graph.node:
        node.input[:] = [renamed.get(n, n) for n in node.input]
    onnx.save(model, str(path))
    return path


def _runtime_package(out: Path, python: str) -> Path:
    """Pack tvm (runtime only) and apache-tvm-ffi's wheel for ``python`` into out/tvm-runtime.tar.xz."""
    from importlib import metadata

    import tvm
    import tvm_ffi

    stage = Path(tempfile.mkdtemp(prefix="tvm-runtime-"))
    site = stage / "site"
    ignore = shutil.ignore_patterns("__pycache__", "libtvm_compiler.so", "3rdparty", "src", "include", "web")
    shutil.copytree(Path(tvm.__file__).parent, site / "tvm", ignore=ignore)
    version = metadata.version("apache-tvm-ffi")
    if python == f"{sys.version_info.major}.{sys.version_info.minor}":
        shutil.copytree(Path(tvm_ffi.__file__).parent, site / "tvm_ffi", ignore=shutil.ignore_patterns("__pycache__"))
    else:  # tvm_ffi's Cython core is built per Python: take the wheel made for the GPU machine's
        wheels = stage / "wheels"
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", python,
             "--platform", "manylinux_2_28_x86_64", "-d", str(wheels), f"apache-tvm-ffi=={version}"],
            check=True,
        )  # fmt: skip
        (wheel,) = wheels.glob("*.whl")
        shutil.unpack_archive(str(wheel), str(site), format="zip")
    packed = out / "tvm-runtime.tar.xz"
    with tarfile.open(packed, "w:xz", preset=6) as tar:
        tar.add(site, arcname="site")
    shutil.rmtree(stage)
    return packed


def build(out: Path, arch: str, python: str) -> None:
    import numpy as np
    import onnxruntime as ort

    sys.path.insert(0, str(ROOT))
    from kiln_testing.models import tiny_cnn_onnx
    from services.exporters.onnxruntime import to_fp16
    from services.pipeline import compile_model
    from services.repository import LocalModelRepository
    from services.spec import load_spec
    from services.storage import LocalArtifactStore

    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpucheck-"))
    sources = {"cnn": tiny_cnn_onnx(work / "cnn.onnx"), "resnet": _resnet_onnx(work / "resnet.onnx")}
    rng = np.random.default_rng(0)
    for name, onnx_path in sources.items():
        spec = load_spec(
            {"targets": ["tvm"], "name": name, "benchmark": False, "options": {"tvm": {"cuda_arch": arch}}}
        )
        result = compile_model(
            onnx_path, spec, store=LocalArtifactStore(work / "store"), repository=LocalModelRepository(work / "repo")
        )
        target = result.targets["tvm"]
        if target.status != "succeeded":
            raise SystemExit(f"{name}: {target.error}")
        version = work / "repo" / "tvm" / name / "1"
        dest = out / name
        dest.mkdir(exist_ok=True)
        for file in ("model_cuda.so", "params.bin", "io.json", "kiln-manifest.json"):
            shutil.copy2(version / file, dest / file)
        shutil.copy2(onnx_path, dest / "model.onnx")
        to_fp16(onnx_path, dest / "model_fp16.onnx")
        x = rng.standard_normal((BATCH, 3, 32, 32)).astype(np.float32)
        session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
        (y,) = session.run(None, {session.get_inputs()[0].name: x})
        np.savez(dest / "io.npz", x=x, y=y)
    packed = _runtime_package(out, python)
    sizes = {p.relative_to(out).as_posix(): p.stat().st_size for p in out.rglob("*") if p.is_file()}
    total = sum(sizes.values())
    print(json.dumps({"files": sizes, "total_mib": round(total / 2**20, 2)}, indent=2))
    if total > 60 * 2**20:
        raise SystemExit(f"the carry is {total / 2**20:.1f} MiB: over the 64 MiB a GPU machine takes")
    print(f"packed {packed} ({packed.stat().st_size / 2**20:.1f} MiB); carry {out} to the GPU machine")


# --- run (GPU machine, no Kiln, no network) --------------------------------------------------------


def _snr_db(actual: Any, expected: Any) -> float:
    import numpy as np

    noise = float(np.sum((actual.astype(np.float64) - expected) ** 2))
    signal = float(np.sum(expected.astype(np.float64) ** 2))
    return float("inf") if noise == 0 else 10 * np.log10(signal / noise)


def _median_ms(fn: Any, iterations: int = 50, warmup: int = 5) -> float:
    import statistics

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iterations):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def _load_tvm(carry: Path) -> Any:
    site = Path(tempfile.mkdtemp(prefix="tvm-site-"))
    with tarfile.open(carry / "tvm-runtime.tar.xz") as tar:
        tar.extractall(site, filter="data")
    sys.path.insert(0, str(site / "site"))
    os.environ["TVM_USE_RUNTIME_LIB"] = "1"
    import ctypes

    # libcudart.so.13: the CUDA 13 runtime wheel's, where the loader does not look on its own.
    for root in map(Path, sys.path):
        for lib in sorted(root.glob("nvidia/*/lib/libcudart.so.13")):
            ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
            break
    import tvm.runtime

    ctypes.CDLL(str(Path(tvm.__file__).parent / "lib" / "libtvm_runtime_cuda.so"), mode=ctypes.RTLD_LOCAL)
    return tvm


def _tvm_row(tvm: Any, folder: Path, x: Any, y: Any) -> dict[str, Any]:
    from tvm.runtime.vm import VirtualMachine

    dev = tvm.runtime.cuda(0)
    started = time.perf_counter()
    vm = VirtualMachine(tvm.runtime.load_module(str(folder / "model_cuda.so")), dev)
    params = tvm.runtime.load_param_dict((folder / "params.bin").read_bytes())
    weights = [tvm.runtime.tensor(params[f"p{i}"].numpy(), dev) for i in range(len(params))]
    dev.sync()
    load_s = time.perf_counter() - started
    feed = tvm.runtime.tensor(x, dev)
    main = vm["main"]

    def call() -> Any:
        out = main(feed, *weights)
        dev.sync()
        return out

    result = call()
    actual = (result if hasattr(result, "numpy") else result[0]).numpy()
    return {
        "load_s": load_s,
        "snr_db": _snr_db(actual, y),
        "max_abs": float(abs(actual - y).max()),
        "ms": _median_ms(call),
    }


def _ort_row(model: Path, provider: str, x: Any, y: Any) -> dict[str, Any]:
    import onnxruntime as ort

    started = time.perf_counter()
    session = ort.InferenceSession(str(model), providers=[provider, "CPUExecutionProvider"])
    if session.get_providers()[0] != provider:
        return {"error": f"{provider} did not start (runs {session.get_providers()})"}
    load_s = time.perf_counter() - started
    name = session.get_inputs()[0].name
    (actual,) = session.run(None, {name: x})
    ms = _median_ms(lambda: session.run(None, {name: x}))
    return {"load_s": load_s, "snr_db": _snr_db(actual, y), "max_abs": float(abs(actual - y).max()), "ms": ms}


def run(carry: Path, out: Path | None) -> int:
    import numpy as np
    import onnxruntime as ort

    tvm = _load_tvm(carry)
    device = tvm.runtime.cuda(0)
    gpu = f"{device.device_name} (compute capability {device.compute_version})"
    rows: list[dict[str, Any]] = []
    for name in MODELS:
        folder = carry / name
        io = np.load(folder / "io.npz")
        x, y = io["x"], io["y"]
        cpu = _ort_row(folder / "model.onnx", "CPUExecutionProvider", x, y)
        rows.append({"model": name, "runtime": "onnxruntime CPU (fp32)", **cpu})
        rows.append({"model": name, "runtime": "Kiln TVM model_cuda.so (fp32)", **_tvm_row(tvm, folder, x, y)})
        if "CUDAExecutionProvider" in ort.get_available_providers():
            for precision, file in (("fp32", "model.onnx"), ("fp16", "model_fp16.onnx")):
                row = _ort_row(folder / file, "CUDAExecutionProvider", x, y)
                rows.append({"model": name, "runtime": f"onnxruntime CUDA ({precision})", **row})
        else:
            rows.append(
                {
                    "model": name,
                    "runtime": "onnxruntime CUDA",
                    "error": f"onnxruntime {ort.__version__} here has no CUDA provider",
                }
            )
        for row in rows[-4:]:
            if row["model"] == name and "ms" in row and "ms" in cpu:
                row["vs_cpu"] = cpu["ms"] / row["ms"]
    lines = [f"GPU: {gpu}; batch {BATCH}; median of 50 calls after 5 warm-up", "",
             "| model | runtime | load (s) | SNR vs source (dB) | max abs | p50 (ms) | vs onnxruntime CPU |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['runtime']} | — | — | — | — | {r['error']} |")
            continue
        lines.append(
            f"| {r['model']} | {r['runtime']} | {r['load_s']:.3f} | {r['snr_db']:.1f} | {r['max_abs']:.2e} | "
            f"{r['ms']:.3f} | {r.get('vs_cpu', 1.0):.1f}x |"
        )
    table = "\n".join(lines)
    print(table)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.md").write_text(table + "\n")
        (out / "gpu_check.json").write_text(json.dumps({"gpu": gpu, "rows": rows}, indent=2, default=str))
    tvm_rows = [r for r in rows if r["runtime"].startswith("Kiln TVM")]
    ok = all(r["load_s"] < 0.5 and r["snr_db"] >= 100 for r in tvm_rows)
    print("PASS: every TVM CUDA library loads in under 0.5 s and agrees at >= 100 dB" if ok else "FAIL")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build and pack the carry here (CPU machine, Kiln's venv)")
    b.add_argument("--out", type=Path, default=ROOT / "gpucheck")
    b.add_argument("--arch", default="sm_90", help="CUDA architecture of the GPU machine (H100/H200: sm_90)")
    b.add_argument("--python", default="3.12", help="the GPU machine's Python (for apache-tvm-ffi's wheel)")
    r = sub.add_parser("run", help="run the carry on a GPU (no Kiln, no network)")
    r.add_argument("--carry", type=Path, default=ROOT / "gpucheck")
    r.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.command == "build":
        build(args.out, args.arch, args.python)
        return 0
    return run(args.carry, args.out)


if __name__ == "__main__":
    sys.exit(main())
