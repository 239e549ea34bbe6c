"""One pipeline step: compile a model on a Kiln service, download the artifacts, fail on any failed target.

Used as is by the GitHub Actions workflow (``python kiln_step.py ...``) and the Airflow task;
the Kubeflow component carries the same few lines (a KFP component must be self-contained).
Needs only ``kiln-client`` (httpx). Exit statuses: 0 when every target succeeded, 1 when one
failed (``PARITY_FAILED``, ``CONVERSION_FAILED``, ...), 2 when the service refused the
request (``INVALID_SPEC``, ``UNSAFE_INPUT``, ``NO_ROUTE``, ...), 3 when it could not be reached.

    KILN_SERVER=http://kiln:8000 KILN_TOKEN=... python kiln_step.py model.onnx spec.json artifacts/
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from kiln_client import Client, KilnError

#: Refusals of the request itself (the pipeline's input is wrong), as `kiln compile` exits 2 for.
INPUT_CODES = {"INVALID_SPEC", "UNSUPPORTED_FORMAT", "SOURCE_UNREADABLE", "UNSAFE_INPUT", "NO_ROUTE", "UNSUPPORTED_OPS"}


def compile_model(
    server: str,
    model: str | Path,
    spec: dict[str, Any],
    dest: str | Path,
    *,
    token: str | None = None,
    calibration: str | Path | None = None,
    timeout: float = 3600.0,
) -> dict[str, Any]:
    """Compile ``model`` on ``server``, download every target's artifact into ``dest``; return the job's summary.

    Raises :class:`kiln_client.KilnError` when the request is refused or a target failed
    (its code: ``PARITY_FAILED``, ...), so the pipeline step fails with the reason.
    """
    with Client(server, token=token) as kiln:
        job = kiln.compile(model, spec, calibration, timeout=timeout)
        job.raise_for_failure()
        folders = {target: str(job.download(target, dest)) for target in job.targets}
    return {
        "job_id": job.id,
        "status": job.status,
        "targets": {
            name: {"route": t.route, "parity": (t.parity or {}).get("passed"), "published": t.published}
            for name, t in job.targets.items()
        },
        "artifacts": folders,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("spec", help="CompileSpec JSON file")
    parser.add_argument("dest", help="where the artifacts go")
    parser.add_argument("--calibration")
    parser.add_argument("--server", default=os.environ.get("KILN_SERVER"))
    parser.add_argument("--timeout", type=float, default=3600.0)
    args = parser.parse_args(argv)
    if not args.server:
        parser.error("give --server or set KILN_SERVER")
    spec = json.loads(Path(args.spec).read_text())
    try:
        summary = compile_model(
            args.server,
            args.model,
            spec,
            args.dest,
            token=os.environ.get("KILN_TOKEN"),
            calibration=args.calibration,
            timeout=args.timeout,
        )
    except KilnError as err:
        print(f"error {err.code}: {err.message}", file=sys.stderr)
        if err.hint:
            print(f"hint: {err.hint}", file=sys.stderr)
        if err.code == "SERVICE_UNAVAILABLE" and err.status is None:
            return 3
        return 2 if err.code in INPUT_CODES else 1
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
