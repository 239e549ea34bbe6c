"""Runners: load a model of one format on its native engine and run it on numpy inputs.

The reference step runs the source model with its own framework; each exporter runs its
artifact with its engine; the benchmark times the same runner. One interface for all.
"""

from services.runners.base import ModelRunner, TensorSpec, open_runner, register_runner

__all__ = ["ModelRunner", "TensorSpec", "open_runner", "register_runner"]
