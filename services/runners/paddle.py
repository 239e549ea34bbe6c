"""Run PaddlePaddle inference models with Paddle Inference on the CPU: the reference for Paddle sources.

The model is vetted (:func:`services.formats.paddle.vet_paddle_model`) and only its program
and parameters are copied into a private directory before Paddle sees them. Paddle's graph
optimisation passes are off (``switch_ir_optim(False)``): the reference is the program as
saved, not a fused rewrite of it. Input and output dtypes and shapes come from the program
itself; the predictor knows them only after a run.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from services.errors import EngineUnavailable, SourceUnreadable, tool_said
from services.formats.paddle import PaddleModel, stage_paddle_model, vet_paddle_model
from services.runners.base import ModelRunner, TensorSpec, contiguous

__all__ = ["PaddleRunner", "import_paddle", "open_predictor"]


def import_paddle() -> Any:
    """Return ``paddle.inference``, imported without Paddle's import-time notices (no ccache, ...).

    Importing Paddle into a process that has already imported TensorFlow crashes it with a
    segmentation fault (measured: paddlepaddle 3.3.1 after tensorflow 2.21; the other order
    works). Refuse with a code instead of taking the process down.
    """
    if "paddle" not in sys.modules and "tensorflow" in sys.modules:
        raise EngineUnavailable(
            "Paddle cannot be loaded into a process that has already loaded TensorFlow (it crashes)",
            hint="Run Paddle sources on the paddle worker (kiln worker --engine paddle), or import paddle first.",
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import paddle.inference

    return paddle.inference


def open_predictor(model: PaddleModel, *, threads: int | None = None) -> Any:
    """Return a CPU Paddle Inference predictor for a vetted, staged model; SOURCE_UNREADABLE when Paddle refuses it."""
    pi = import_paddle()

    config = pi.Config(str(model.program), str(model.params))
    config.disable_gpu()
    config.switch_ir_optim(False)
    config.disable_glog_info()
    if threads:
        config.set_cpu_math_library_num_threads(threads)
    try:
        return pi.create_predictor(config)
    except Exception as exc:  # Paddle raises its own enforce errors (RuntimeError, ValueError, ...)
        text = str(exc).strip()
        raise SourceUnreadable(
            f"Paddle cannot load {model.program.name}: {tool_said(text, exc)}",
            hint="Save the model again with paddle.jit.save and upload its program and .pdiparams together.",
        ) from exc


class PaddleRunner(ModelRunner):
    """A Paddle Inference predictor over a vetted, privately staged copy of the model."""

    def __init__(self, path: Path, *, threads: int | None = None, **_: Any) -> None:
        vetted = vet_paddle_model(Path(path))
        self._dir = Path(tempfile.mkdtemp(prefix="kiln-paddle-"))
        try:
            self.model = stage_paddle_model(vetted, self._dir)
            self.predictor = open_predictor(self.model, threads=threads)
        except BaseException:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self.inputs = [self._spec(n) for n in self.predictor.get_input_names()]
        self.outputs = [self._spec(n) for n in self.predictor.get_output_names()]

    def _spec(self, name: str) -> TensorSpec:
        dtype, shape = self.model.shapes.get(name, ("float32", ()))
        return TensorSpec(name, dtype, shape)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        for spec in self.inputs:
            handle = self.predictor.get_input_handle(spec.name)
            arr = contiguous(feeds[spec.name])
            handle.reshape(list(arr.shape))
            handle.copy_from_cpu(arr)
        self.predictor.run()
        return {o.name: self.predictor.get_output_handle(o.name).copy_to_cpu() for o in self.outputs}

    def close(self) -> None:
        self.predictor = None
        shutil.rmtree(self._dir, ignore_errors=True)
