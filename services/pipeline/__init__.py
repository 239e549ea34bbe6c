"""Running plans: the step executor, the reference and publish steps, and the in-process compile."""

from services.pipeline.executor import StepOutcome, run_step, step_cache_key
from services.pipeline.local import CompileResult, TargetResult, compile_model, default_model_name

__all__ = [
    "CompileResult",
    "StepOutcome",
    "TargetResult",
    "compile_model",
    "default_model_name",
    "run_step",
    "step_cache_key",
]
