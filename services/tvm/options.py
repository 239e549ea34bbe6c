"""The tvm target's options in the compile spec (``tvm`` in CompileSpec)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["MAX_TUNING_TRIALS", "TvmOptions"]

#: A budget far past what one compile job should spend; MetaSchedule's own examples use 20000.
MAX_TUNING_TRIALS = 100_000


class TvmOptions(BaseModel):
    """How the tvm target compiles: CPU model, an optional CUDA library, MetaSchedule tuning."""

    model_config = ConfigDict(extra="forbid")

    mcpu: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9_.+-]{1,64}$",
        description="LLVM CPU to compile for (e.g. znver4, skylake-avx512, x86-64-v3); unset: the worker's own CPU.",
    )
    cuda_arch: str | None = Field(
        default=None,
        pattern=r"^sm_[0-9]{2,3}[af]?$",
        description=(
            "Also cross-compile a CUDA library (model_cuda.so) for this GPU architecture, e.g. sm_90; it is built "
            "without a GPU and not run by Kiln (parity is checked on the CPU library)."
        ),
    )
    tuning_trials: int = Field(
        default=0,
        ge=0,
        le=MAX_TUNING_TRIALS,
        description=(
            "MetaSchedule trial budget for the CPU library (0: untuned, TVM's default schedules). Tuning needs "
            "static shapes: open axes take the spec's inputs shape (or opt)."
        ),
    )
