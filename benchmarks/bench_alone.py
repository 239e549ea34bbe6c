"""Benchmark noise with and without the host gate: a step's latency numbers while another job runs.

    .venv/bin/python benchmarks/bench_alone.py [--rounds 3] [--iterations 200]

Three cases, side by side in alternating order, each compiling a BERT-class model (transformers,
random weights, TorchScript export: kiln_testing/transformer_models.py) to onnxruntime with its
latency benchmark (batch 1 and 8):

- ``quiet``: nothing else runs on the host (the baseline);
- ``beside``: a neighbour process compiles other jobs (the CNN to OpenVINO, cache off, in a
  loop: real conversion, parity and publish steps) and the benchmark does not wait for it
  (``KILN_BENCH_QUIET_WAIT=0``), which is how every benchmark ran before the gate;
- ``alone``: the same neighbour, and the gate (services/steps/host_gate.py): the benchmark
  waits for the neighbour's running step and holds its next one back.

Reported per case: median over rounds of p50, p99 and p99/p50 at each batch size, the ratio
of p50 to the quiet case's, and the rows' ``alone`` flag. Steps of both processes share one
lock directory of their own, so other work on the machine is not gated (it is noise that
no case escapes: the load average is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

NEIGHBOUR = """
import sys, itertools
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from services.pipeline import compile_model
from services.repository import LocalModelRepository
from services.spec import load_spec
from services.storage import LocalArtifactStore
model, work, stop = Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
for i in itertools.count():
    if stop.exists():
        break
    spec = load_spec({"targets": ["openvino"], "name": f"n{i}", "benchmark": False})
    compile_model(model, spec, store=LocalArtifactStore(work / f"store{i}"),
                  repository=LocalModelRepository(work / "repo"), use_cache=False)
"""


def _compile_once(model: Path, work: Path, iterations: int, tag: str) -> list[dict[str, Any]]:
    from services.pipeline import compile_model
    from services.repository import LocalModelRepository
    from services.spec import load_spec
    from services.storage import LocalArtifactStore

    spec = load_spec(
        {
            "targets": ["onnxruntime"],
            "name": tag,
            "benchmark": {"batch_sizes": [1, 8], "warmup": 10, "iterations": iterations},
        }
    )
    result = compile_model(
        model,
        spec,
        store=LocalArtifactStore(work / f"store-{tag}"),
        repository=LocalModelRepository(work / "repo"),
        use_cache=False,
    )
    target = result.targets["onnxruntime"]
    assert target.status == "succeeded", target.error
    return list(target.benchmark)


def main() -> None:
    from kiln_testing.models import tiny_cnn_onnx
    from kiln_testing.transformer_models import torch_transformer

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=200)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kiln-bench-alone-"))
    os.environ["KILN_HOST_LOCK_DIR"] = str(work / "locks")
    model, _ = torch_transformer("bert", "torchscript", work / "bert.onnx")
    neighbour_model = tiny_cnn_onnx(work / "cnn.onnx")
    cases = ["quiet", "beside", "alone"]
    rows: dict[str, list[list[dict[str, Any]]]] = {c: [] for c in cases}
    print(f"load average before: {os.getloadavg()}")
    for r in range(args.rounds):
        order = cases if r % 2 == 0 else cases[::-1]
        for case in order:
            neighbour = None
            stop = work / f"stop-{r}-{case}"
            if case != "quiet":
                neighbour = subprocess.Popen(
                    [sys.executable, "-c", NEIGHBOUR, str(ROOT), str(neighbour_model), str(work / "n"), str(stop)],
                    env={**os.environ},
                )
                time.sleep(8)  # let it get into its loop (imports, first conversion)
            os.environ["KILN_BENCH_QUIET_WAIT"] = "0" if case == "beside" else "120"
            try:
                rows[case].append(_compile_once(model, work, args.iterations, f"{case}{r}"))
            finally:
                if neighbour is not None:
                    stop.touch()
                    neighbour.wait(300)
            print(
                f"round {r} {case}: "
                + json.dumps(
                    [
                        (b["batch_size"], round(b["p50_ms"], 3), round(b["p99_ms"], 3), b["alone"])
                        for b in rows[case][-1]
                    ]
                )
            )
    print(f"load average after: {os.getloadavg()}")
    print("\n| case | batch | p50 ms | p99 ms | p99/p50 | p50 vs quiet | alone |")
    print("|---|---|---|---|---|---|---|")
    quiet_p50 = {}
    for case in cases:
        for i, batch in enumerate(b["batch_size"] for b in rows[case][0]):
            p50 = statistics.median(run[i]["p50_ms"] for run in rows[case])
            p99 = statistics.median(run[i]["p99_ms"] for run in rows[case])
            ratio = statistics.median(run[i]["p99_ms"] / run[i]["p50_ms"] for run in rows[case])
            quiet_p50.setdefault(batch, p50)
            alone = {run[i]["alone"] for run in rows[case]}
            print(
                f"| {case} | {batch} | {p50:.3f} | {p99:.3f} | {ratio:.2f} | {p50 / quiet_p50[batch]:.2f} | {sorted(alone)} |"
            )


if __name__ == "__main__":
    main()
