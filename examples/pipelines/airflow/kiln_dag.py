"""An Airflow DAG whose task compiles a model on a Kiln service and fails on any failed target.

The task calls ``kiln_step.compile_model`` (beside this folder's parent, examples/pipelines),
which raises ``KilnError`` — failing the task, so Airflow retries it or marks it failed —
when a target fails parity or the service refuses the model. No Airflow retries: the client
already retries what is transient (dropped connections, 502/503/504, with idempotent
submits), and a target that failed parity would fail again.

Settings: the service's URL in the environment's ``KILN_SERVER`` or the Airflow Variable
``kiln_server``; the token in ``KILN_TOKEN`` or the Variable ``kiln_token`` (none with auth
off). The model path, spec and destination come from the DAG's params.
"""

from __future__ import annotations

import os
import sys
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from airflow.sdk import Param, Variable, dag, task

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kiln_step.py, shared with the other examples

from kiln_step import compile_model

DEFAULT_SPEC: dict[str, Any] = {"targets": ["onnxruntime", "openvino"], "precision": "fp32"}


@dag(
    dag_id="kiln_compile",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    params={
        "model": Param("/data/models/model.onnx", type="string"),
        "spec": Param(DEFAULT_SPEC, type="object"),
        "dest": Param("/data/artifacts", type="string"),
    },
    default_args={"retries": 0},
    tags=["kiln"],
)
def kiln_compile() -> None:
    @task(task_id="compile_on_kiln", execution_timeout=timedelta(hours=2))
    def compile_on_kiln(params: dict[str, Any] | None = None) -> dict[str, Any]:
        params = params or {}
        return compile_model(
            os.environ.get("KILN_SERVER") or Variable.get("kiln_server"),
            params["model"],
            params["spec"],
            params["dest"],
            token=os.environ.get("KILN_TOKEN") or Variable.get("kiln_token", default=None),
        )

    compile_on_kiln()


kiln_compile_dag = kiln_compile()
