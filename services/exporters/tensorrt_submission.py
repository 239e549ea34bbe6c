"""The tensorrt target's check at submission (its descriptor's ``preflight``): the parser, after the optimiser."""

from __future__ import annotations

import logging

from services.formats import DetectedSource, Format
from services.spec import CompileSpec

__all__ = ["check_submission"]

log = logging.getLogger("kiln.api")


def check_submission(source: DetectedSource, spec: CompileSpec) -> None:
    """Refuse an ONNX model TensorRT's parser cannot import now (422 UNSUPPORTED_OPS with the ops).

    The export step checks again on the GPU worker (other sources reach ONNX only there);
    checking here means a job whose model cannot build never waits in the GPU queue, which
    may have no worker at all. A few milliseconds for real models (docs/benchmarks.md); the
    weights are not read. The worker builds the *optimised* model, and the optimiser may
    remove what the check flags (an op on constants folded away, a dead branch), so a model
    that fails as uploaded is optimised here and checked again before it is refused.
    """
    if source.format is not Format.ONNX:
        return
    from services.descriptors.tensorrt import TensorRTOptions, variant_major
    from services.tensorrt.preflight import preflight, raise_if_unsupported

    major = variant_major(spec.engine_options(TensorRTOptions).variant)
    report = preflight(source.path, tensorrt_major=major)
    if report.ok:
        return
    if spec.optimize:
        from services.onnx_io import load_onnx
        from services.passes.pipeline import optimize_model

        try:
            optimized, _ = optimize_model(load_onnx(source.path))
        except Exception:  # the worker's own check decides then
            log.warning("TensorRT pre-flight: could not optimise the upload to check it again", exc_info=True)
            return
        report = preflight(optimized, tensorrt_major=major)
    raise_if_unsupported(report)
