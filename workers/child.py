"""Run one plan step in a child process, so a crashing converter fails its step, not the worker.

Children come from a multiprocessing *forkserver*: a clean, single-threaded process started
once per worker process that has imported Kiln's step code and the fork-safe engine
libraries (numpy, onnx, onnxruntime, openvino). Forking from it costs milliseconds, where
spawning a fresh interpreter and importing them again would cost about a second per step.
TensorFlow and torch are never preloaded: neither supports being forked after import,
so steps that need them import them in the child.

The child writes its stdout/stderr (and faulthandler's dump on a segfault) to a log file,
sends progress lines and its result over a pipe, and dies with its parent (PR_SET_PDEATHSIG).
The parent enforces the soft (SIGTERM) and hard (SIGKILL) time limits, stops the child when
the job is cancelled, and turns a death by signal into CONVERSION_FAILED naming the signal
and the tail of the child's output.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.errors import Cancelled, ConversionFailed, KilnError, Timeout
from services.settings import Settings

__all__ = ["ChildResult", "StepRequest", "fetch_local", "preload_modules", "run_in_child"]

#: Modules every step child needs; importing them once in the forkserver is what makes forks cheap.
_BASE_PRELOAD = (
    # The main module once, in the forkserver: each child would otherwise re-import it
    # (the `kiln` script, pytest, ...) before running its step.
    "__main__",
    "workers._forkserver_main",
    "numpy",
    "onnx",
    "services.pipeline.executor",
    "services.pipeline.reference",
    "services.exporters._common",
    "services.repository.step",
    "services.settings",
    "services.jobs.backends",
    "services.storage.factory",
    "workers.child",
)
#: Preloaded only when a location is on S3: boto3 in the forkserver makes every fork ~80 ms slower.
_S3_PRELOAD = ("services.storage.s3", "services.repository.s3")
#: Engine libraries known to be safe to fork after import (they start no threads that matter).
_ENGINE_PRELOAD = {
    "onnxruntime": ("onnxruntime", "services.exporters.onnxruntime", "services.passes.step"),
    "openvino": ("openvino", "onnxruntime", "services.exporters.openvino", "services.converters.openvino_ir"),
}

LOG_TAIL_CHARS = 4000
STORED_LOG_CHARS = 64_000


@dataclass
class StepRequest:
    """Everything the child needs (pickled to it): ids and keys, never model bytes."""

    job_id: str
    step: dict[str, Any]
    spec: dict[str, Any]
    source_key: str
    source_filename: str
    input_keys: dict[str, str]
    settings: Settings
    scratch: Path
    calibration_key: str | None = None
    calibration_filename: str | None = None
    calibration_sha256: str | None = None
    use_cache: bool = True


@dataclass
class ChildResult:
    """How the child ended: a stored artifact, or a Kiln error; and its output."""

    ok: bool
    key: str | None = None
    cached: bool = False
    seconds: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)
    error: dict[str, Any] | None = None
    log: str = ""
    lost: bool = False  # the step was taken over by another worker; record nothing


def preload_modules(engines: list[str], settings: Settings | None = None) -> list[str]:
    """Return the modules the forkserver imports for a worker serving ``engines``."""
    mods = list(_BASE_PRELOAD)
    for e in engines:
        mods.extend(m for m in _ENGINE_PRELOAD.get(e, ()) if m not in mods)
    if settings is not None and any(loc.startswith("s3://") for loc in (settings.store_location, settings.repository)):
        mods.extend(_S3_PRELOAD)
    return mods


_CONTEXT: Any = None


def _context(engines: list[str] | None = None, settings: Settings | None = None) -> Any:
    global _CONTEXT
    if _CONTEXT is None:
        from multiprocessing import spawn

        from workers._forkserver_main import ENV

        main_path = spawn.get_preparation_data("kiln").get("init_main_from_path")
        if main_path:
            os.environ[ENV] = main_path
        ctx = multiprocessing.get_context("forkserver")
        # Missing optional modules are skipped by the forkserver itself.
        ctx.set_forkserver_preload(preload_modules(engines or [], settings))
        _CONTEXT = ctx
    return _CONTEXT


def configure(engines: list[str], settings: Settings | None = None) -> None:
    """Choose what this process's forkserver preloads (call before the first step)."""
    _context(engines, settings)


def fetch_local(store: Any, key: str, cache_root: Path) -> Path:
    """Return a local directory holding ``key``: the store's own path, or a copy cached per host."""
    local = store.local_path(key)
    if local is not None:
        return Path(local)
    dest = cache_root / key.replace("/", "_")
    if (dest / ".kiln-fetched").exists():
        return dest
    tmp = cache_root / f".tmp-{dest.name}-{os.getpid()}-{time.monotonic_ns()}"
    store.fetch_dir(key, tmp)
    (tmp / ".kiln-fetched").touch()
    try:
        os.rename(tmp, dest)
    except OSError:  # another process fetched it first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _die_with_parent() -> None:
    # Linux only: ask the kernel to SIGKILL us when the forkserver (our parent) exits, which
    # it does when the worker process that started it dies; no orphaned conversions.
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _redirect_output(log_path: Path) -> None:
    import faulthandler
    import sys

    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    faulthandler.enable(file=sys.stderr)


def _json_safe(meta: dict[str, Any]) -> dict[str, Any]:
    # Artifact meta may hold numpy scalars or paths; the parent stores it as JSON.
    body = {k: v for k, v in meta.items() if k not in ("lineage", "signature")}
    return json.loads(json.dumps(body, default=str))  # type: ignore[no-any-return]


def _child_main(req: StepRequest, conn: Any, log_path: Path) -> None:
    """Body of the child process: run the step through the executor and report back."""
    _die_with_parent()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _redirect_output(log_path)
    try:
        payload = _run(req, lambda m: conn.send(("progress", m)))
    except KilnError as exc:
        payload = {"ok": False, "error": exc.to_dict()}
    except BaseException as exc:  # the step must report, whatever happened
        tail = traceback.format_exc()[-LOG_TAIL_CHARS:]
        err = ConversionFailed(
            f"step {req.step['id']} failed: {type(exc).__name__}: {exc}",
            step=req.step["id"],
            tool=req.step.get("tool", ""),
            output_tail=tail,
        )
        payload = {"ok": False, "error": err.to_dict()}
    conn.send(("done", payload))
    conn.close()
    # Leave now: the artifact is stored and the result sent. A normal exit would join
    # library threads (OpenVINO's telemetry keeps one), costing up to a second per step.
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _uploaded_file(directory: Path, filename: str) -> Path:
    """Return the uploaded file in a ``sources/<sha256>`` directory.

    Keys are content addresses, so the same bytes uploaded earlier under another name share
    the directory, which then holds the first upload's name: take its only file.
    """
    wanted = directory / filename
    if wanted.exists():
        return wanted
    files = [p for p in directory.iterdir() if p.is_file() and not p.name.startswith(".kiln")]
    return files[0] if len(files) == 1 else wanted


def _run(req: StepRequest, progress: Callable[[str], None]) -> dict[str, Any]:
    from services.formats import Format, open_source
    from services.graph.planner import PlanStep
    from services.jobs.backends import open_repository, open_store
    from services.pipeline.executor import run_step
    from services.spec import CompileSpec

    settings = req.settings
    store = open_store(settings)
    spec = CompileSpec.model_validate(req.spec)
    step = PlanStep.from_dict(req.step)
    fetch_root = settings.cache_dir / "worker-fetch"
    fetch_root.mkdir(parents=True, exist_ok=True)
    src_dir = fetch_local(store, req.source_key, fetch_root)
    work = req.scratch / "work"
    work.mkdir(parents=True, exist_ok=True)
    override = Format(spec.source_format) if spec.source_format else None
    source = open_source(_uploaded_file(src_dir, req.source_filename), work, override)
    calibration_path = None
    if req.calibration_key and req.calibration_filename:
        calibration_path = _uploaded_file(fetch_local(store, req.calibration_key, fetch_root), req.calibration_filename)
    repository = open_repository(settings) if step.kind == "publish" else None
    outcome = run_step(
        step,
        job_id=req.job_id,
        spec=spec,
        source=source,
        input_keys=req.input_keys,
        store=store,
        scratch=req.scratch / "step",
        repository=repository,
        on_progress=progress,
        calibration_path=calibration_path,
        calibration_sha=req.calibration_sha256,
        use_cache=req.use_cache,
    )
    return {
        "ok": True,
        "key": outcome.key,
        "cached": outcome.cached,
        "seconds": outcome.seconds,
        "meta": _json_safe(outcome.meta),
    }


def _read_tail(path: Path, n: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def run_in_child(
    req: StepRequest,
    *,
    soft_limit: float,
    hard_limit: float,
    on_progress: Callable[[str], None] | None = None,
    tick: Callable[[], str | None] | None = None,
    tick_interval: float = 1.0,
) -> ChildResult:
    """Run ``req`` in a forked child and wait for it; never raises for what the step does.

    ``tick`` is called every ``tick_interval`` seconds while the child runs and may answer
    "cancel" (stop it: CANCELLED) or "lost" (stop it: another worker owns the step now).
    """
    req.scratch.mkdir(parents=True, exist_ok=True)
    log_path = req.scratch / "step.log"
    ctx = _context()
    parent_conn, child_conn = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_main, args=(req, child_conn, log_path), name=f"kiln-step-{req.step['id']}")
    started = time.monotonic()
    proc.start()
    child_conn.close()
    payload: dict[str, Any] | None = None
    stop_reason: str | None = None  # cancel | lost | timeout
    terminated_at: float | None = None
    next_tick = started + tick_interval
    eof = False
    while True:
        if eof:
            proc.join(0.1)
        else:
            try:
                if parent_conn.poll(0.1):
                    kind, body = parent_conn.recv()
                    if kind == "progress" and on_progress is not None:
                        on_progress(str(body))
                    elif kind == "done":
                        payload = body
            except (EOFError, OSError):
                eof = True  # the child closed its end: it finished or died
        if not proc.is_alive():
            break
        now = time.monotonic()
        if tick is not None and now >= next_tick and stop_reason is None:
            next_tick = now + tick_interval
            verdict = tick()
            if verdict in ("cancel", "lost"):
                stop_reason = verdict
                proc.kill()
        if stop_reason is None and now - started > soft_limit:
            stop_reason, terminated_at = "timeout", now
            proc.terminate()  # SIGTERM: the soft limit
        if terminated_at is not None and now - terminated_at > max(hard_limit - soft_limit, 1.0):
            proc.kill()  # the hard limit
    proc.join()
    # Drain anything sent just before exit.
    while payload is None:
        try:
            if not parent_conn.poll(0):
                break
            kind, body = parent_conn.recv()
            if kind == "done":
                payload = body
            elif on_progress is not None:
                on_progress(str(body))
        except (EOFError, OSError):
            break
    parent_conn.close()
    seconds = time.monotonic() - started
    log = _read_tail(log_path, STORED_LOG_CHARS)
    step_id = req.step["id"]
    if stop_reason == "lost":
        return ChildResult(ok=False, lost=True, seconds=seconds, log=log)
    err: KilnError
    if stop_reason == "cancel":
        err = Cancelled(f"step {step_id} was stopped: its job was cancelled", step=step_id)
        return ChildResult(ok=False, error=err.to_dict(), seconds=seconds, log=log)
    if payload is not None:
        return ChildResult(
            ok=bool(payload.get("ok")),
            key=payload.get("key"),
            cached=bool(payload.get("cached")),
            seconds=float(payload.get("seconds", seconds)),
            meta=payload.get("meta") or {},
            error=payload.get("error"),
            log=log,
        )
    tail = log[-LOG_TAIL_CHARS:]
    if stop_reason == "timeout":
        err = Timeout(
            f"step {step_id} exceeded its time limit of {soft_limit:.0f}s and was stopped",
            step=step_id,
            output_tail=tail,
        )
        return ChildResult(ok=False, error=err.to_dict(), seconds=seconds, log=log)
    code = proc.exitcode or 0
    how = f"was killed by {_signal_name(code)}" if code < 0 else f"exited with status {code}"
    if code == -signal.SIGKILL:
        how += " (out of memory, or killed from outside)"
    err = ConversionFailed(
        f"step {step_id} crashed in {req.step.get('tool') or 'its tool'}: the process {how}",
        step=step_id,
        tool=req.step.get("tool", ""),
        exit_code=code,
        output_tail=tail,
    )
    return ChildResult(ok=False, error=err.to_dict(), seconds=seconds, log=log)
