"""Run helm-python-sdk in a process of its own: ``python tests/helm_process.py`` reads one
JSON request on stdin and writes one JSON answer on stdout.

Why not in the test process: helm-python-sdk loads Helm, a Go program, as a shared library,
and the Go runtime installs its own handlers for every signal. In a process that already
runs engine thread pools (onnxruntime, OpenVINO, TensorFlow) that crashed the whole pytest
run with SIGSEGV: in the helm lint call itself after the OpenVINO tests, and in a later test
that makes a step child segfault (measured; the tests pass when run alone). A subprocess
per call keeps Helm's runtime out of the test process; it costs a second or so per call.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

CHART = Path(__file__).resolve().parents[1] / "helm" / "kiln"


def call(op: str, values: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run ``op`` (render, lint, validate) on the chart with ``values`` in a fresh process."""
    proc = subprocess.run(
        [sys.executable, __file__],
        input=json.dumps({"op": op, "values": values}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"helm {op} process failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


def _serve(request: dict[str, Any]) -> dict[str, Any]:
    import helm_python as helm

    op, values = request["op"], request.get("values")
    if op == "lint":
        return {"report": helm.lint(CHART, values, strict=True, namespace="ml")}
    with helm.Chart.load(CHART) as chart:
        if op == "render":
            return {"manifests": chart.render(values=values, name="kiln", namespace="ml", is_install=True)}
        if op == "validate":
            try:
                chart.validate_schema(chart.merge_values(values))
            except helm.HelmValuesError as err:
                return {"values_error": str(err)}
            return {"values_error": None}
    raise ValueError(f"unknown op {op!r}")


if __name__ == "__main__":
    json.dump(_serve(json.load(sys.stdin)), sys.stdout, default=str)
