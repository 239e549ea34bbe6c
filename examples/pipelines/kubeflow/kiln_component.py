"""A Kubeflow Pipelines component that compiles a model on a Kiln service, and a pipeline using it.

The component installs only ``kiln-client`` in its container, uploads the model artifact,
waits for the job, downloads every target's artifact into its output, and raises (failing
the run) when a target fails: ``PARITY_FAILED``, ``CONVERSION_FAILED``, or a refusal.

    python kiln_component.py kiln_pipeline.yaml   # compile the pipeline to its IR YAML

No ``from __future__ import annotations`` here: KFP reads the component's annotations as
types (Input[Model], Output[Artifact]), not strings.
"""

import sys

from kfp import compiler, dsl
from kfp.dsl import Artifact, Input, Model, Output


@dsl.component(base_image="python:3.11-slim", packages_to_install=["kiln-client"])
def kiln_compile(
    server: str,
    model: Input[Model],
    spec_json: str,
    artifacts: Output[Artifact],
    token: str = "",
    timeout_s: float = 3600.0,
) -> str:
    """Compile ``model`` on the Kiln service at ``server`` with the CompileSpec ``spec_json``; return the job id."""
    import json

    from kiln_client import Client

    with Client(server, token=token or None) as kiln:
        job = kiln.compile(model.path, json.loads(spec_json), timeout=timeout_s)
        job.raise_for_failure()  # KilnError PARITY_FAILED (or another code) fails the step
        for target in job.targets:
            job.download(target, artifacts.path)
    artifacts.metadata["kiln_job"] = job.id
    artifacts.metadata["targets"] = {name: t.route for name, t in job.targets.items()}
    return job.id


@dsl.pipeline(name="kiln-compile", description="Compile a model for its serving engines on Kiln.")
def kiln_pipeline(server: str, model_uri: str, spec_json: str = '{"targets": ["onnxruntime", "openvino"]}') -> None:
    source = dsl.importer(artifact_uri=model_uri, artifact_class=Model, reimport=False)
    kiln_compile(server=server, model=source.output, spec_json=spec_json)


if __name__ == "__main__":
    compiler.Compiler().compile(kiln_pipeline, package_path=sys.argv[1] if len(sys.argv) > 1 else "kiln_pipeline.yaml")
