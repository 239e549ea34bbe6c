"""MetaSchedule tuning in this process: a builder and a runner without MetaSchedule's worker pools.

MetaSchedule's LocalBuilder and LocalRunner start Popen workers that import TVM afresh; on a
loaded CPU that start alone ran past their 60 s timeout and every candidate came back as a
build error. Building and timing candidates here, one after the other, is what a worker
with one compile job at a time wants anyway: the tuning budget is spent on candidates.
"""

from __future__ import annotations

import contextlib
import inspect
import linecache
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from services.errors import ConversionFailed

__all__ = ["tune_module"]


def _frames(frame: FrameType | None) -> list[inspect.FrameInfo]:
    out = []
    while frame is not None:
        filename, lineno = frame.f_code.co_filename, frame.f_lineno or 0
        line = linecache.getline(filename, lineno)
        context = [line] if line else None
        out.append(inspect.FrameInfo(frame, filename, lineno, frame.f_code.co_name, context, 0 if line else None))
        frame = frame.f_back
    return out


@contextlib.contextmanager
def _cheap_stack_inspection() -> Iterator[None]:
    """Make ``inspect.stack`` cheap while TVM parses its built-in TVMScript kernels.

    MetaSchedule imports ``tvm.s_tir.tensor_intrin``, which parses ~500 TVMScript functions at
    import, each calling ``inspect.stack()``; that resolves every frame's module by scanning
    ``sys.modules`` (frozen importlib frames are never cached), which took 28 to 54 s here
    for an import that parses in about one. TVM reads only each frame, its line number and
    its current source line, which this gives without the scan.
    """
    stack, outer = inspect.stack, inspect.getouterframes
    inspect.stack = lambda context=1: _frames(sys._getframe(1))  # type: ignore[assignment]
    inspect.getouterframes = lambda frame, context=1: _frames(frame)  # type: ignore[assignment]
    try:
        yield
    finally:
        inspect.stack, inspect.getouterframes = stack, outer


def _classes() -> tuple[type, type, type]:
    with _cheap_stack_inspection():
        import tvm.s_tir.tensor_intrin  # noqa: F401 - parsed once here, fast; MetaSchedule imports it

    from tvm.ir.utils import derived_object
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.builder import BuilderResult, PyBuilder
    from tvm.s_tir.meta_schedule.builder.local_builder import default_build
    from tvm.s_tir.meta_schedule.runner import EvaluatorConfig, PyRunner, RunnerResult
    from tvm.s_tir.meta_schedule.runner.local_runner import default_alloc_argument, default_run_evaluator
    from tvm.s_tir.meta_schedule.runner.runner import PyRunnerFuture

    @derived_object
    class DoneFuture(PyRunnerFuture):
        def __init__(self, costs: list[float] | None, error: str | None) -> None:
            super().__init__()
            self.costs = costs
            self.error = error

        def done(self) -> bool:
            return True

        def result(self) -> Any:
            return RunnerResult(self.costs, self.error)

    @derived_object
    class InProcessBuilder(PyBuilder):
        def __init__(self, scratch: str) -> None:
            super().__init__()
            self.scratch = scratch

        def build(self, build_inputs: list[Any]) -> list[Any]:
            out = []
            for bi in build_inputs:
                try:
                    # MetaSchedule's measure callback removes the folder of each built candidate.
                    path = os.path.join(tempfile.mkdtemp(dir=self.scratch), "candidate.so")
                    default_build(bi.mod, bi.target, None).export_library(path)
                    out.append(BuilderResult(path, None))
                except Exception as exc:  # a candidate that does not build is a tuning result, not a failure
                    out.append(BuilderResult(None, f"{type(exc).__name__}: {exc}"))
            return out

    @derived_object
    class InProcessRunner(PyRunner):
        def __init__(self, number: int = 3, repeat: int = 1) -> None:
            super().__init__()
            self.config = EvaluatorConfig(number=number, repeat=repeat, min_repeat_ms=0, enable_cpu_cache_flush=False)

        def run(self, runner_inputs: list[Any]) -> list[Any]:
            import tvm

            out = []
            for ri in runner_inputs:
                try:
                    mod = tvm.runtime.load_module(ri.artifact_path)
                    # MetaSchedule names the device by the target kind; TVM 0.27's runtime knows "cpu", not "llvm".
                    kind = str(ri.device_type)
                    dev = tvm.runtime.device("cpu" if kind in ("llvm", "c") else kind, 0)
                    args_info = tuple(arg.as_json() for arg in ri.args_info)
                    args = default_alloc_argument(dev, args_info, 1)
                    costs = default_run_evaluator(mod, dev, self.config, args)
                    out.append(DoneFuture([float(c) for c in costs], None))
                except Exception as exc:
                    out.append(DoneFuture(None, f"{type(exc).__name__}: {exc}"))
            return out

    del ms
    return InProcessBuilder, InProcessRunner, DoneFuture


def tune_module(mod: Any, target: Any, trials: int, work_dir: Path, *, seed: int = 0) -> tuple[Any, dict[str, Any]]:
    """Return ``mod`` with MetaSchedule's best schedules for its fused kernels, and a tuning summary.

    ``mod`` must be legalised and fused (``LegalizeOps``, ``FuseOps``, ``FuseTIR``) and have
    static shapes. Functions named ``*_transform_params`` run once at export, so are not tuned.
    """
    import tvm
    from tvm import relax
    from tvm.s_tir import meta_schedule as ms

    builder_cls, runner_cls, _ = _classes()
    tuned = tvm.IRModule({gv: f for gv, f in mod.functions.items() if not gv.name_hint.endswith("_transform_params")})
    work_dir.mkdir(parents=True, exist_ok=True)
    # The gradient scheduler gives each task one round of num_trials_per_iter first; a round as
    # large as the budget spent all of it on the first task (a reshape), so rounds share it out.
    tasks = len(ms.relax_integration.extract_tasks(tuned, target))
    per_round = max(1, min(64, trials // max(1, tasks)))
    with tempfile.TemporaryDirectory(prefix="kiln-tvm-candidates-") as scratch:
        database = ms.relax_integration.tune_relax(
            tuned,
            {},
            target,
            str(work_dir),
            trials,
            num_trials_per_iter=per_round,
            builder=builder_cls(scratch),
            runner=runner_cls(),
            cost_model="random",  # xgboost is not a dependency; the budgets here are too small to train one
            # Search effort scaled to the budget: MetaSchedule's defaults (a population of 512 evolved 4 times
            # per round) cost minutes per round on a small CPU even when the budget is a handful of trials.
            strategy=ms.search_strategy.EvolutionarySearch(
                population_size=min(512, max(16, 8 * trials)),
                init_min_unmeasured=min(50, max(8, 2 * trials)),
                genetic_num_iters=4 if trials >= 64 else 1,
            ),
            seed=seed,
        )
    records = database.get_all_tuning_records()
    with target, tvm.transform.PassContext(opt_level=3):
        applied = relax.transform.MetaScheduleApplyDatabase(str(work_dir))(mod)
    # MetaSchedule records a candidate that failed to build or run with a 1e10 s sentinel.
    measured = [r for r in records if r.run_secs and min(float(t) for t in r.run_secs) < 1e9]
    if records and not measured:
        raise ConversionFailed(
            f"MetaSchedule measured none of its {len(records)} candidates on this CPU",
            hint="Set options.tvm.tuning_trials to 0 for TVM's default schedules; the job log has MetaSchedule's errors.",
            tool="tvm.meta_schedule",
        )
    summary = {
        "trials": trials,
        "tasks": tasks,
        "records": len(records),
        "measured": len(measured),
        "cost_model": "random",
    }
    return applied, summary
