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
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from services.errors import ConversionFailed
from services.tvm.host import configure_threads

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
        def __init__(self, scratch: str, deadline: float = float("inf")) -> None:
            super().__init__()
            self.scratch = scratch
            self.deadline = deadline

        def build(self, build_inputs: list[Any]) -> list[Any]:
            out = []
            for bi in build_inputs:
                if time.monotonic() > self.deadline:  # the time budget is spent: the search runs out of candidates
                    out.append(BuilderResult(None, "Kiln's tuning time budget is spent"))
                    continue
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


def tuning_store() -> Path:
    """Return the shared tuning database's folder: ``KILN_TVM_TUNING_DIR``, else one per user in /var/tmp.

    Read from the environment like the host's benchmark locks: a step gets no Settings, and
    the sandbox binds this folder writable and names it in the step's environment
    (services/sandbox/view.py). /var/tmp outlives a reboot, as a tuning database should.
    """
    configured = os.environ.get("KILN_TVM_TUNING_DIR")
    return Path(configured) if configured else Path(f"/var/tmp/kiln-tvm-tuning-{os.getuid()}")


def _task_key(task: Any, target: Any) -> str:
    """Return a task's content key: its kernel (structurally hashed), the target, the threads it is
    timed on (the best schedule for one thread is not the best for two), TVM's version."""
    import hashlib

    import tvm
    import tvm_ffi

    kernel = tvm_ffi.structural_hash(task.dispatched[0])
    text = f"{tvm.__version__}|{target}|threads={configure_threads()}|{kernel}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _entries(kernel: Path) -> list[tuple[int, Path]]:
    """Return the finished entries of a kernel's folder with the per-kernel budget each was tuned with."""
    out = []
    for entry in kernel.glob("t*-*") if kernel.is_dir() else []:
        try:
            out.append((int(entry.name[1:].split("-", 1)[0]), entry))
        except ValueError:
            continue
    return out


def _load_stored(kernel: Path, database: Any, budget: int) -> bool:
    """Commit every record stored for a kernel into ``database`` when one was tuned with at least ``budget``
    trials; False (tune it) otherwise. A job given a larger budget than earlier ones tunes the kernel again."""
    from tvm.s_tir import meta_schedule as ms

    entries = _entries(kernel)
    if not any(trials >= budget for trials, _ in entries):
        return False
    loaded = False
    for _, entry in entries:
        try:
            stored = ms.database.JSONDatabase(
                str(entry / "workloads.json"), str(entry / "records.json"), allow_missing=False
            )
            records = stored.get_all_tuning_records()
        except Exception:  # damaged: the others still count
            continue
        for record in records:
            workload = database.commit_workload(record.workload.mod)
            database.commit_tuning_record(
                ms.database.TuningRecord(record.trace, workload, record.run_secs, record.target, record.args_info)
            )
            loaded = True
    return loaded


def _store_best(kernel: Path, task: Any, source: Any, target: Any, budget: int) -> bool:
    """Add the best measured record of ``task`` from ``source`` as a new entry of ``kernel``; True if written.

    The entry is written into a private folder first and renamed into place in one step under a
    name of its own (``t<budget>-<random>``): a worker reading the store sees whole entries only,
    and two workers that tuned the same kernel at once both add theirs (the faster one wins when
    a later job applies them).
    """
    from tvm.s_tir import meta_schedule as ms

    mod = task.dispatched[0]
    if not source.has_workload(mod):
        return False
    best = [r for r in source.get_top_k(source.commit_workload(mod), 1) if r.run_secs and _measured(r)]
    if not best:
        return False
    try:
        kernel.mkdir(parents=True, exist_ok=True)
        private = Path(tempfile.mkdtemp(prefix=".writing-", dir=kernel))
    except OSError as exc:
        raise StoreUnwritable(f"{kernel.parent}: {exc}") from exc
    try:
        out = ms.database.JSONDatabase(str(private / "workloads.json"), str(private / "records.json"))
        workload = out.commit_workload(mod)
        record = best[0]
        out.commit_tuning_record(
            ms.database.TuningRecord(record.trace, workload, record.run_secs, target, record.args_info)
        )
        os.rename(private, kernel / f"t{budget}-{private.name.rsplit('-', 1)[-1]}")
        return True
    except OSError as exc:
        raise StoreUnwritable(f"{kernel}: {exc}") from exc
    finally:
        if private.exists():
            import shutil

            shutil.rmtree(private, ignore_errors=True)


#: Below this many trials XGBoost has too few measurements to learn from; random sampling is as good, and cheaper.
XGB_MIN_TRIALS = 64


def _cost_model(trials: int) -> str:
    """Return MetaSchedule's cost model: XGBoost where it is installed (the tvm extra) and the budget can train it."""
    import importlib.util

    if trials >= XGB_MIN_TRIALS and importlib.util.find_spec("xgboost") is not None:
        return "xgb"
    return "random"


@contextlib.contextmanager
def _named_handlers_only(name: str = "tvm.s_tir.meta_schedule") -> Iterator[None]:
    """Detach the unnamed handlers of MetaSchedule's logger while it configures its own loggers.

    MetaSchedule rebuilds a ``logging.config`` dict from its logger's handlers by name on every
    tuning run; a handler with no name (one a host process attached, or a run before this one
    in the same process left) makes it fail with ``'NoneType' object has no attribute 'format'``
    (measured: the second tuning job of a process).
    """
    import logging

    logger = logging.getLogger(name)
    unnamed = [h for h in logger.handlers if h.get_name() is None]
    for handler in unnamed:
        logger.removeHandler(handler)
    try:
        yield
    finally:
        for handler in unnamed:
            logger.addHandler(handler)


class StoreUnwritable(OSError):
    """The shared tuning database cannot be written (the library is still built from this job's tuning)."""


def _measured(record: Any) -> bool:
    # MetaSchedule records a candidate that failed to build or run with a 1e10 s sentinel.
    return bool(record.run_secs) and min(float(t) for t in record.run_secs) < 1e9


def tune_module(
    mod: Any,
    target: Any,
    trials: int,
    work_dir: Path,
    *,
    store: Path | None = None,
    seconds: float | None = None,
    seed: int = 0,
) -> tuple[Any, dict[str, Any]]:
    """Return ``mod`` with MetaSchedule's best schedules for its fused kernels, and a tuning summary.

    ``mod`` must be legalised and fused (``LegalizeOps``, ``FuseOps``, ``FuseTIR``) and have
    static shapes. Functions named ``*_transform_params`` run once at export, so are not tuned.
    Kernels already in ``store`` (the shared database: one folder per kernel, keyed by its
    content and the target) take their stored schedule and are not tuned again; the budget
    goes to the others, and their best schedules are added to the store. After ``seconds`` no
    candidate is built: the search ends with the best measured so far.
    """
    import tvm
    from tvm import relax
    from tvm.s_tir import meta_schedule as ms

    builder_cls, runner_cls, _ = _classes()
    tuned = tvm.IRModule({gv: f for gv, f in mod.functions.items() if not gv.name_hint.endswith("_transform_params")})
    work_dir.mkdir(parents=True, exist_ok=True)
    tasks = ms.relax_integration.extract_tasks(tuned, target)
    database = ms.database.MemoryDatabase()
    keys = {task.task_name: _task_key(task, target) for task in tasks}
    budget = -(-trials // max(1, len(tasks)))  # each kernel's share of the budget: what a stored entry must match
    reused = [t for t in tasks if store is not None and _load_stored(store / keys[t.task_name], database, budget)]
    todo = [t for t in tasks if t not in reused]
    records: list[Any] = []
    stored = 0
    store_error = None
    cost_model = _cost_model(trials)
    started = time.monotonic()
    deadline = started + seconds if seconds else float("inf")
    if todo:
        # The gradient scheduler gives each task one round of num_trials_per_iter first; a round as
        # large as the budget spent all of it on the first task (a reshape), so rounds share it out.
        per_round = max(1, min(64, trials // len(todo)))
        with _named_handlers_only():
            contexts, weights = ms.relax_integration.extracted_tasks_to_tune_contexts(
                extracted_tasks=todo,
                work_dir=str(work_dir),
                # Search effort scaled to the budget: MetaSchedule's defaults (a population of 512 evolved 4
                # times per round) cost minutes per round on a small CPU even for a handful of trials.
                strategy=ms.search_strategy.EvolutionarySearch(
                    population_size=min(512, max(16, 8 * trials)),
                    init_min_unmeasured=min(50, max(8, 2 * trials)),
                    genetic_num_iters=4 if trials >= 64 else 1,
                ),
                seed=seed,
            )
        with tempfile.TemporaryDirectory(prefix="kiln-tvm-candidates-") as scratch:
            fresh = ms.tune.tune_tasks(
                tasks=contexts,
                task_weights=weights,
                work_dir=str(work_dir),
                max_trials_global=trials,
                num_trials_per_iter=per_round,
                builder=builder_cls(scratch, deadline),
                runner=runner_cls(),
                cost_model=cost_model,
            )
        records = fresh.get_all_tuning_records()
        if records and not any(_measured(r) for r in records):
            raise ConversionFailed(
                f"MetaSchedule measured none of its {len(records)} candidates on this CPU",
                hint="Set options.tvm.tuning_trials to 0 for TVM's default schedules; the job log has MetaSchedule's "
                "errors.",
                tool="tvm.meta_schedule",
            )
        for task in todo:
            try:
                if store is not None and _store_best(store / keys[task.task_name], task, fresh, target, budget):
                    stored += 1
            except StoreUnwritable as exc:
                store_error = str(exc)
            mod_ = task.dispatched[0]
            if fresh.has_workload(mod_):
                for record in fresh.get_top_k(fresh.commit_workload(mod_), 1):
                    workload = database.commit_workload(mod_)
                    database.commit_tuning_record(
                        ms.database.TuningRecord(record.trace, workload, record.run_secs, target, record.args_info)
                    )
    with target, database, tvm.transform.PassContext(opt_level=3):
        applied = relax.transform.MetaScheduleApplyDatabase()(mod)
    scheduled = sum(
        1
        for gv, f in applied.functions.items()
        if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None and f.attrs.get("tirx.is_scheduled")
    )
    summary = {
        "trials": trials,
        "tasks": len(tasks),
        "reused": len(reused),
        "tuned": len(todo),
        "records": len(records),
        "measured": sum(1 for r in records if _measured(r)),
        "stored": stored,
        "scheduled_kernels": scheduled,
        "cost_model": cost_model,
        "seconds": round(time.monotonic() - started, 1),
        "stopped_at_time_budget": time.monotonic() > deadline,
    }
    if store_error:
        summary["store_error"] = store_error
    return applied, summary
