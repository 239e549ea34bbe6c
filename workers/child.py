"""Run plan steps in child processes, so a crashing converter fails its step, not the worker.

Children come from a multiprocessing *forkserver*: a clean, single-threaded process started
once per worker process that has imported Kiln's step code and the fork-safe engine
libraries (numpy, onnx, onnxruntime, openvino). Forking from it costs milliseconds, where
spawning a fresh interpreter and importing them again would cost about a second per step.
TensorFlow and torch are never preloaded: neither supports being forked after import,
so steps that need them import them in the child.

A child that finished a step cleanly stays and serves the worker's next step: the engines'
first-use costs (sessions, plugins, lazy imports, version look-ups: 30-90 ms per step on
this code base's steps) and the fork are paid once per child instead of once per step, as
they are in the in-process ``kiln compile``. It retires after any failure, after
``MAX_STEPS_PER_CHILD`` steps, when it has grown past ``MAX_CHILD_RSS``, or after
``CHILD_IDLE_SECONDS`` without work; a step that is cancelled, lost or over its time limit
takes its child with it. So a crash still fails one step and never the worker.

Each step writes its stdout/stderr (and faulthandler's dump on a segfault) to its own log
file, sends progress lines and its result over a pipe. Children die with the forkserver
(PR_SET_PDEATHSIG), which dies with the worker. The parent enforces the soft (SIGTERM) and
hard (SIGKILL) time limits, stops the child when the job is cancelled, and turns a death by
signal into CONVERSION_FAILED naming the signal and the tail of the child's output.

Children are sandboxed (services/sandbox, docs/security.md): the forkserver starts inside
bubblewrap (no network, an empty root with only the interpreter, the code and the
read-only artifact folders bound in, no environment secrets), and each child confines
itself with Landlock to its own folder under ``<cache>/sandbox`` before it takes a step.
So the child only runs the step's function on local files: this (trusted) process fetches
the inputs, opens the source, stores the output (taken back without following anything the
child left in it) and publishes. Messages from a child are JSON, never unpickled here, and
whatever it printed or reported is cut of the configured secrets (services/sandbox/redact.py).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import multiprocessing
import multiprocessing.util  # its exit hook must be registered before ours (see shutdown_children)
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from services.artifacts import Artifact
from services.descriptors import concrete_engines
from services.errors import Cancelled, ConversionFailed, KilnError, StorageFull, Timeout
from services.outages import storage_full
from services.sandbox import Protection, Redactor, SandboxView, gpu_devices, host_protection, sandbox_view
from services.sandbox.inputs import StagedInputs
from services.sandbox.outputs import claim_output
from services.settings import Settings
from services.steps.context import Progress, StepContext
from services.storage.base import ArtifactStore
from workers.startup_output import ROOT_ENV, startup_output

__all__ = [
    "CHILD_IDLE_SECONDS",
    "MAX_CHILD_RSS",
    "MAX_STEPS_PER_CHILD",
    "ChildResult",
    "StepRequest",
    "fetch_local",
    "preload_modules",
    "protection",
    "run_in_child",
    "shutdown_children",
]

#: Modules every step child needs; importing them once in the forkserver is what makes forks cheap.
_BASE_PRELOAD = (
    # First: from here on, each forked child writes to its own file (see the module).
    "workers._forkserver_output",
    # The main module once, in the forkserver: each child would otherwise re-import it
    # (the `kiln` script, pytest, ...) before running its step.
    "__main__",
    "workers._forkserver_main",
    "numpy",
    "onnx",
    "services.pipeline.executor",
    "services.pipeline.reference",
    "services.exporters._common",
    "services.pipeline.publish",
    "services.settings",
    "services.jobs.backends",
    "services.storage.factory",
    "workers.child",
)
#: Imported after everything else: fills caches every child would rebuild, freezes the heap.
_WARM = "workers._forkserver_warm"
#: Preloaded only when a location is on S3: boto3 in the forkserver makes every fork ~80 ms slower.
_S3_PRELOAD = ("services.storage.s3", "services.repository.s3")
#: Engine libraries known to be safe to fork after import (they start no threads that matter):
#: each engine descriptor's ``preload``.
_ENGINE_PRELOAD = {name: e.preload for name, e in concrete_engines().items() if e.preload}
#: Engines whose worker image asks for a GPU (the descriptor's image.gpus): their steps get the GPU's device nodes.
_GPU_ENGINES = frozenset(name for name, e in concrete_engines().items() if e.image.gpus > 0)

LOG_TAIL_CHARS = 4000
STORED_LOG_CHARS = 64_000

#: A child serves at most this many steps, then a fresh one is forked (bounds slow leaks).
MAX_STEPS_PER_CHILD = 100
#: A child whose resident memory is above this after a step retires instead of idling on it.
MAX_CHILD_RSS = 1 << 30
#: An idle child leaves after this many seconds without a step (its memory goes back).
CHILD_IDLE_SECONDS = 300.0
#: How long an idle child may take to acknowledge a step before a fresh one is used instead.
ACK_TIMEOUT = 10.0
#: The longest progress line a step may report, and the most JSON data one may carry.
MAX_PROGRESS_CHARS = 4000
MAX_PROGRESS_DATA_BYTES = 256 << 10  # a tune's every candidate, ~375 bytes each
#: The largest message a child may send (its artifact's metadata, an error): more is a broken child.
MAX_MESSAGE_BYTES = 16 << 20


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
    evaluation_key: str | None = None
    evaluation_filename: str | None = None
    evaluation_sha256: str | None = None
    use_cache: bool = True
    # What the API detected and hashed at upload; with them a plain-file source is not read
    # again by every step (hashing a 1 GiB model takes seconds).
    source_format: str | None = None
    source_sha256: str | None = None
    source_seen: str = ""
    route_attempts: list[dict[str, Any]] | None = None  # publish steps: for the manifest
    tenant: str = ""  # whose job: a step child never serves two tenants


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
    pid: int | None = None  # the child process that ran the step


def preload_modules(engines: list[str], settings: Settings | None = None) -> list[str]:
    """Return the modules the forkserver imports for a worker serving ``engines``."""
    mods = list(_BASE_PRELOAD)
    for e in engines:
        mods.extend(m for m in _ENGINE_PRELOAD.get(e, ()) if m not in mods)
    if settings is not None and any(loc.startswith("s3://") for loc in (settings.store_location, settings.repository)):
        mods.extend(_S3_PRELOAD)
    mods.append(_WARM)
    return mods


_CONTEXT: Any = None
#: Where step children write before (and between) their steps; fixed when the forkserver first starts.
_OUTPUT_ROOT: Path | None = None
#: The name of every step child's process: the preparation data of these is adjusted (see below).
_STEP_PROCESS = "kiln-step"
#: The protection this process's step children get, and the view its forkserver was started with.
_PROTECTION: Protection | None = None
_VIEW: SandboxView | None = None
#: Device nodes the sandbox binds in for this worker's steps, fixed by the engines it serves (configure()).
_DEVICES: tuple[Path, ...] = ()
_SANDBOX_LOCK = threading.Lock()


def _context(engines: list[str] | None = None, settings: Settings | None = None) -> Any:
    global _CONTEXT
    if _CONTEXT is None:
        from multiprocessing import spawn

        from workers._forkserver_main import ENV

        main_path = spawn.get_preparation_data("kiln").get("init_main_from_path")
        if main_path:
            os.environ[ENV] = main_path
        _prepare_in_children_root()
        ctx = multiprocessing.get_context("forkserver")
        # Missing optional modules are skipped by the forkserver itself.
        ctx.set_forkserver_preload(preload_modules(engines or [], settings))
        _CONTEXT = ctx
    if engines is not None:
        _fix_devices(engines)
    if settings is not None:
        _fix_output_root(settings)
        _ensure_sandbox(settings)
    return _CONTEXT


def _fix_devices(engines: list[str]) -> None:
    """Give the sandbox the GPU's device nodes when this worker serves an engine that runs on one.

    Without them a GPU step saw an empty /dev inside bubblewrap (the CUDA driver found no
    device) and Landlock refused the driver's ioctls; a CPU worker never gets them.
    """
    global _DEVICES
    if _GPU_ENGINES.intersection(engines):
        _DEVICES = gpu_devices()


def _fix_output_root(settings: Settings) -> None:
    """Tell the forkserver (before it starts) where its children write their startup output."""
    global _OUTPUT_ROOT
    if _OUTPUT_ROOT is None:
        _OUTPUT_ROOT = _children_root(settings)
        _OUTPUT_ROOT.mkdir(parents=True, exist_ok=True)
        os.environ[ROOT_ENV] = str(_OUTPUT_ROOT)


def _prepare_in_children_root() -> None:
    """Make every step child start in the children's area, not in this process's working directory.

    multiprocessing's preparation of a child ``chdir``s to its parent's working directory,
    whatever that is (the directory `kiln serve` was started from). Inside the sandbox's
    empty root that directory does not exist, so the child died before running anything.
    The children's area exists on both sides (it is bound in at the same path), and each
    child moves into its own folder there anyway. ``get_preparation_data`` is looked up on
    the module for every start, and only ``kiln-step`` processes are changed.
    """
    from multiprocessing import spawn

    original = spawn.get_preparation_data
    if getattr(original, "kiln_step_dir", False):
        return

    def get_preparation_data(name: str) -> dict[str, Any]:
        data: dict[str, Any] = original(name)
        if name == _STEP_PROCESS and _OUTPUT_ROOT is not None:
            data["dir"] = str(_OUTPUT_ROOT)
        return data

    get_preparation_data.kiln_step_dir = True  # type: ignore[attr-defined]
    spawn.get_preparation_data = get_preparation_data


def protection(settings: Settings) -> Protection:
    """Return (and fix, for this process) the protection step children get under ``settings``."""
    global _PROTECTION
    if _PROTECTION is None:
        _PROTECTION = host_protection(settings.sandbox)
    return _PROTECTION


def _ensure_sandbox(settings: Settings) -> None:
    """Start (or restart, when a step needs folders it does not see) the forkserver inside the sandbox."""
    global _VIEW
    prot = protection(settings)
    if not prot.confined:
        return
    with _SANDBOX_LOCK:
        root = _VIEW.root if _VIEW is not None else settings.cache_dir / "sandbox"
        # Neither the artifact store nor the fetch cache: each step's own inputs are linked into
        # its process's folder of the inputs area (services/sandbox/inputs.py).
        inputs = _VIEW.inputs if _VIEW is not None else settings.cache_dir / "sandbox-in"
        view = sandbox_view(root, read=[*(_VIEW.read if _VIEW else ())], inputs=inputs, devices=_DEVICES)
        if _VIEW is not None and _VIEW.covers(view):
            return
        import multiprocessing.forkserver as fs

        from services.sandbox.launcher import write_launcher

        if _VIEW is not None:  # a forkserver without these folders: its children could not read them
            shutdown_children()
            fs._forkserver._stop()  # type: ignore[attr-defined]
        _CONTEXT.set_executable(str(write_launcher(prot, view, root / ".launcher")))
        _VIEW = view


def configure(engines: list[str], settings: Settings | None = None) -> None:
    """Choose what this process's forkserver preloads and how its children are sandboxed (before the first step)."""
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


# --- the child ---------------------------------------------------------------------------


def _die_with_parent() -> None:
    # Linux only: ask the kernel to SIGKILL us when the forkserver (our parent) exits, which
    # it does when the worker process that started it dies; no orphaned conversions.
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _abort_on_exit() -> None:
    """Make a library's ``exit()`` in this child end the process at once (SIGABRT), skipping teardown.

    A model can make its framework call ``exit()`` in the middle of a step (TensorFlow's
    ``Abort(exit_without_error=True)``). In a child forked from the forkserver, ``exit()`` then
    runs the preloaded libraries' destructors, which join threads that will never finish:
    the child hung, neither working nor dead, holding its worker slot until the step's time
    limit (issue 31). C ``atexit`` handlers run last-registered first, so one registered here,
    after the forkserver's libraries loaded, runs before their destructors and aborts: the
    step fails at once (killed by SIGABRT; faulthandler prints where). The child's own way out
    is ``os._exit``, which runs no handlers.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.__cxa_atexit.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        libc.__cxa_atexit(ctypes.cast(libc.abort, ctypes.c_void_p).value, None, None)
    except (OSError, AttributeError):
        pass


def _greet(conn: Any) -> None:
    """Tell the parent we are up, with a pidfd of this process (the parent's only handle on it).

    Under bubblewrap the children live in a PID namespace: the pid the forkserver reports is
    meaningless to the worker. A pidfd names the process itself, across namespaces; it is sent
    before any step (untrusted code) runs here, so it cannot name another process.
    """
    from multiprocessing import reduction

    try:
        pidfd = os.pidfd_open(os.getpid())
    except (AttributeError, OSError):
        pidfd = None
    _send(conn, ["hello", {"pidfd": pidfd is not None}])
    if pidfd is not None:
        reduction.send_handle(conn, pidfd, 0)
        os.close(pidfd)


def _apply_limits(limits: dict[str, int]) -> None:
    """Set this process's resource limits (soft and hard: a step cannot raise them again)."""
    import resource

    names = {
        "address_space": resource.RLIMIT_AS,
        "processes": resource.RLIMIT_NPROC,
        "open_files": resource.RLIMIT_NOFILE,
        "file_size": resource.RLIMIT_FSIZE,
    }
    for name, value in limits.items():
        which = names.get(name)
        if which is None or value <= 0:
            continue
        _, hard = resource.getrlimit(which)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        try:
            resource.setrlimit(which, (value, value))
        except (ValueError, OSError):
            pass
    # Past the file-size limit a write fails (EFBIG, the step reports it) instead of killing the process.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


#: In a child: its startup output (workers/_forkserver_output.py), kept open for the time between steps.
_BETWEEN_STEPS_FD: int | None = None


def _redirect_output(log_path: Path | None) -> None:
    """Point fds 1 and 2 (so Python, C libraries and faulthandler alike) at ``log_path``.

    ``None``: the child's startup output when it has one (the worker reads it when the child
    dies outside a step), else /dev/null. An open descriptor, because once confined the
    child may not open anything outside its own folder.
    """
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    if log_path is None and _BETWEEN_STEPS_FD is not None:
        fd = os.dup(_BETWEEN_STEPS_FD)
    else:
        fd = os.open(log_path or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _own_output() -> None:
    """Give Python line-buffered streams on fds 1 and 2 and faulthandler's dump on fd 2 (once per child)."""
    import faulthandler
    import sys

    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    faulthandler.enable(file=sys.stderr)


def _json_safe(meta: dict[str, Any]) -> dict[str, Any]:
    # Artifact meta may hold numpy scalars or paths; the parent stores it as JSON.
    body = {k: v for k, v in meta.items() if k not in ("lineage", "signature")}
    return json.loads(json.dumps(body, default=str))  # type: ignore[no-any-return]


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _send(conn: Any, message: list[Any]) -> None:
    # JSON, never pickle: the parent must not unpickle what a confined (untrusted) process sends.
    conn.send_bytes(json.dumps(message, default=str).encode())


def checked_progress(body: Any) -> Progress:
    """Return a progress line as it may be recorded: text of bounded length, or that with bounded JSON data.

    Applied on both sides of the pipe: the child keeps its lines small, and the parent takes
    nothing else from a confined process (anything that is not a line or a small object of
    JSON values becomes its text).
    """
    if isinstance(body, dict):
        line: dict[str, Any] = {"message": str(body.get("message", ""))[:MAX_PROGRESS_CHARS]}
        data = body.get("tune")
        if isinstance(data, dict):
            try:  # finite JSON only: PostgreSQL's json type refuses NaN and Infinity
                text = json.dumps(data, default=str, allow_nan=False)
            except ValueError:
                text = ""
            if text and len(text) <= MAX_PROGRESS_DATA_BYTES:
                line["tune"] = json.loads(text)
        return line
    return str(body)[:MAX_PROGRESS_CHARS]


def _call_reporting(ctx: StepContext, conn: Any) -> dict[str, Any]:
    """Run the step's function on ``ctx`` and return the payload to report, whatever happened."""
    from services.pipeline.executor import call_step_function
    from services.pipeline.memory import StepMemory
    from services.steps.host_gate import host_share

    memory = StepMemory.start()
    ctx.on_progress = lambda m: _send(conn, ["progress", checked_progress(m)])
    try:
        with host_share():  # this process runs the step: its benchmark sets the share down (host_gate)
            art = call_step_function(ctx)
        return {
            "ok": True,
            "root": str(art.root),
            "kind": art.kind,
            "entry": art.entry,
            "meta": art.meta,
            "memory": memory.record(),
        }
    except KilnError as exc:
        return {"ok": False, "error": exc.to_dict()}
    except BaseException as exc:  # the step must report, whatever happened
        step = ctx.step.id
        if storage_full(exc):  # e.g. writing its output into a full scratch disk
            return {"ok": False, "error": StorageFull(f"step {step} ran out of disk space: {exc}", step=step).to_dict()}
        tail = "".join(traceback.format_exception(exc))[-LOG_TAIL_CHARS:]
        err = ConversionFailed(
            f"step {step} failed in {ctx.step.tool}: {type(exc).__name__}: {exc}",
            step=step,
            tool=ctx.step.tool,
            output_tail=tail,
        )
        return {"ok": False, "error": err.to_dict()}


def _enter_step(ctx: StepContext) -> None:
    """Give the step its scratch folder as working directory, HOME and TMPDIR."""
    os.chdir(ctx.scratch)
    for var in ("HOME", "TMPDIR", "TMP", "TEMP"):
        os.environ[var] = str(ctx.scratch)
    import tempfile

    tempfile.tempdir = None  # recomputed from TMPDIR


def _child_loop(
    conn: Any,
    own: str | None = None,
    view: SandboxView | None = None,
    landlock: bool = False,
    inputs: str | None = None,
    limits: dict[str, int] | None = None,
) -> None:
    """Body of a step child: confine itself to ``own`` (reading its ``inputs`` folder), then run the steps
    the parent sends until told to retire."""
    global _BETWEEN_STEPS_FD
    import sys

    _die_with_parent()
    _abort_on_exit()
    if getattr(sys.modules.get("workers._forkserver_output"), "OWNED", False):
        _BETWEEN_STEPS_FD = os.dup(2)
    _redirect_output(None)
    _own_output()
    _greet(conn)
    _apply_limits(limits or {})
    if own is not None:
        Path(own).mkdir(parents=True, exist_ok=True)
        os.chdir(own)
        if landlock and view is not None:
            from services.sandbox.confine import confine_self

            confine_self(view, Path(own), Path(inputs) if inputs else None)
    home, environ = os.getcwd(), dict(os.environ)
    served = 0
    while True:
        try:
            if not conn.poll(CHILD_IDLE_SECONDS):
                break  # idle too long: the parent sees EOF before an ack and forks a fresh child
            msg = conn.recv()
        except (EOFError, OSError):
            break
        if msg is None:
            break
        ctx, log_path = msg
        _send(conn, ["ack", os.getpid()])
        # A previous step may have changed these; each step starts from the child's own.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _redirect_output(Path(log_path))
        _enter_step(ctx)
        payload = _call_reporting(ctx, conn)
        served += 1
        # Only a clean success leaves the child fit for more: after a failure, whatever the
        # tool left behind (threads, half-built state) goes with the process.
        payload["retire"] = not payload.get("ok") or served >= MAX_STEPS_PER_CHILD or _rss_bytes() > MAX_CHILD_RSS
        _redirect_output(None)  # flushes the step's log before the parent reads its tail
        _send(conn, ["done", payload])
        if payload["retire"]:
            break
        os.chdir(home)
        if os.environ != environ:
            os.environ.clear()
            os.environ.update(environ)
        if not conn.poll(1.0):  # no next step right away: collect garbage while idle, off its clock
            import gc

            gc.collect()
    conn.close()
    # Leave now: a normal exit would join library threads (OpenVINO's telemetry keeps one),
    # costing up to a second.
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


def _open_source(req: StepRequest, path: Path, work: Path, override: Any) -> Any:
    """Return the job's source as the executor wants it.

    A plain file is what the API detected and hashed at upload (same detection, same
    override), so it is taken as recorded and vetted as that format (services/formats/vetting.py,
    remembered per process); archives go through open_source, which extracts and vets them,
    with the hash recorded at upload. A source not vetted as the format it is loaded as is refused.
    """
    from services.errors import UnsafeInput
    from services.formats import DetectedSource, Format, open_source
    from services.formats.archives import archive_kind
    from services.formats.vetting import vet_source

    vet = req.settings.vet_uploads
    if req.source_format and req.source_sha256 and path.is_file() and archive_kind(path) is None:
        # Vetted here too, as the format recorded (once per worker process for the same bytes).
        vetted = vet_source(req.source_format, path, sha256=req.source_sha256, enabled=vet)
        source = DetectedSource(
            format=Format(req.source_format), path=path, seen=req.source_seen, sha256=req.source_sha256, vetted=vetted
        )
    else:
        sha = req.source_sha256 if path.is_file() else None
        source = open_source(path, work, override, sha256=sha, vet=vet)
    if vet and source.vetted != source.format.value:  # nothing unvetted reaches a loader
        raise UnsafeInput(f"the source was not vetted as {source.format.value}, the format it would be loaded as")
    return source


class _Lost(BaseException):  # not an Exception: the executor must not turn it into CONVERSION_FAILED
    """The step was taken over by another worker while its child ran: record nothing."""


def _run(req: StepRequest, call: Any, work: Path, progress: Callable[[Progress], None]) -> Any:
    """Fetch the step's inputs, open the source and run the step (its function through ``call``); return the outcome."""
    from services.formats import Format
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
    work.mkdir(parents=True, exist_ok=True)
    override = Format(spec.source_format) if spec.source_format else None
    source = _open_source(req, _uploaded_file(src_dir, req.source_filename), work, override)
    calibration_path = None
    if req.calibration_key and req.calibration_filename:
        calibration_path = _uploaded_file(fetch_local(store, req.calibration_key, fetch_root), req.calibration_filename)
    evaluation_path = None
    if req.evaluation_key and req.evaluation_filename:
        evaluation_path = _uploaded_file(fetch_local(store, req.evaluation_key, fetch_root), req.evaluation_filename)
    # A stored input is read where the child can see it: the store's own folder, or the fetch cache.
    inputs = {r: k for r, k in req.input_keys.items() if store.local_path(k) is None}
    for key in inputs.values():
        fetch_local(store, key, fetch_root)
    repository = open_repository(settings) if step.kind == "publish" else None
    return run_step(
        step,
        job_id=req.job_id,
        spec=spec,
        source=source,
        input_keys=req.input_keys,
        store=cast(ArtifactStore, _FetchedStore(store, fetch_root)),
        scratch=req.scratch / "step",
        repository=repository,
        on_progress=progress,
        calibration_path=calibration_path,
        calibration_sha=req.calibration_sha256,
        evaluation_path=evaluation_path,
        evaluation_sha=req.evaluation_sha256,
        use_cache=req.use_cache,
        route_attempts=req.route_attempts,
        call=call,
    )


class _FetchedStore:
    """The job's store, with inputs read from the host's fetch cache when the store is remote."""

    def __init__(self, store: Any, fetch_root: Path) -> None:
        self._store, self._fetch_root = store, fetch_root

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def local_path(self, key: str) -> Path | None:
        local = self._store.local_path(key)
        if local is not None:
            return Path(local)
        cached = self._fetch_root / key.replace("/", "_")
        return cached if (cached / ".kiln-fetched").exists() else None


# --- the parent --------------------------------------------------------------------------


def _in_pid_namespace() -> bool:
    """True when step children run in a PID namespace of their own (bubblewrap): their pids mean nothing here."""
    return bool(_PROTECTION is not None and _PROTECTION.bwrap and _VIEW is not None)


def _pid_of(pidfd: int) -> int | None:
    """Return the pid, in this process's namespace, of the process ``pidfd`` refers to."""
    try:
        with open(f"/proc/self/fdinfo/{pidfd}") as fh:
            for line in fh:
                if line.startswith("Pid:"):
                    pid = int(line.split()[1])
                    return pid if pid > 0 else None
    except (OSError, ValueError, IndexError):
        pass
    return None


def _gpu_host() -> bool:
    return Path("/dev/nvidiactl").exists()


def step_limits(settings: Settings) -> dict[str, int]:
    """Return the resource limits each step process gets (``_apply_limits``), from the settings."""
    address_space = settings.step_max_address_space
    if not address_space and not _gpu_host():  # CUDA maps the device's memory: no limit on GPU hosts
        address_space = 2 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "address_space": address_space,
        "processes": settings.step_max_processes,
        "open_files": settings.step_max_open_files,
        "file_size": settings.step_max_output_bytes,
    }


class _StepChild:
    """A child process, the parent's end of its pipe, the folder it may write and the one it reads its inputs from.

    ``tenant``: whose steps it serves; an idle child is handed only steps of the same tenant.
    """

    def __init__(self, ctx: Any, root: Path, settings: Settings, tenant: str = "") -> None:
        import uuid

        self.conn, theirs = ctx.Pipe(duplex=True)
        self.dir = root / f"child-{uuid.uuid4().hex[:12]}"
        self.tenant = tenant
        confined = _VIEW is not None and _PROTECTION is not None and _PROTECTION.confined
        landlock = bool(_PROTECTION and _PROTECTION.landlock and _VIEW is not None)
        # Its folder of the inputs area: its steps' inputs are linked there (services/sandbox/inputs.py).
        self.inputs = _VIEW.inputs / self.dir.name if confined and _VIEW is not None and _VIEW.inputs else None
        args = (
            theirs,
            str(self.dir),
            _VIEW if confined else None,
            landlock,
            str(self.inputs) if self.inputs else None,
            step_limits(settings) if confined else {},
        )
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.inputs is not None:
            self.inputs.mkdir(parents=True, exist_ok=True)
        self.proc = ctx.Process(target=_child_loop, args=args, name=_STEP_PROCESS)
        self.proc.start()
        theirs.close()
        self.idle_since = time.monotonic()
        self.retired = False
        self.acked = False  # it has taken a step: from then on, its output goes to the step's log
        self.startup_log = startup_output(_OUTPUT_ROOT, self.proc.pid) if _OUTPUT_ROOT and self.proc.pid else None
        self.greeted = False
        self.pidfd: int | None = None  # from the child's greeting: how this side signals it
        self.host_pid: int | None = None

    @property
    def pid(self) -> int | None:
        """The child's pid as this process sees it (not the forkserver's, in a PID namespace)."""
        return self.host_pid if self.host_pid is not None else (None if _in_pid_namespace() else self.proc.pid)

    def greet(self) -> None:
        """Take the child's greeting (and its pidfd), once, before giving it anything; EOFError when it died."""
        if self.greeted:
            return
        self.greeted = True
        if not self.conn.poll(ACK_TIMEOUT):
            raise EOFError("the step child did not start")
        kind, body = self.recv()
        if kind != "hello" or not isinstance(body, dict):
            raise EOFError("the step child did not greet")
        if body.get("pidfd"):
            from multiprocessing import reduction

            self.pidfd = reduction.recv_handle(self.conn)
            self.host_pid = _pid_of(self.pidfd)

    def send_signal(self, sig: int) -> None:
        """Signal the child (through its pidfd; by pid only when that pid is this namespace's)."""
        if self.pidfd is not None:
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pidfd_send_signal(self.pidfd, sig)
        elif not _in_pid_namespace() and self.proc.pid:
            with contextlib.suppress(ProcessLookupError, OSError):
                os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def cpu_seconds(self) -> float | None:
        """Return the CPU time the child has used so far (all its threads and the children it reaped), or None."""
        if self.host_pid is None:
            return None
        try:
            with open(f"/proc/{self.host_pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime
        except (OSError, ValueError, IndexError):
            return None

    def recv(self) -> list[Any]:
        """Return the child's next message (JSON); EOFError when it is gone or sent something else."""
        try:
            message = json.loads(self.conn.recv_bytes(MAX_MESSAGE_BYTES))
        except (ValueError, UnicodeDecodeError) as exc:  # garbage, or a message over the limit
            raise EOFError(f"the step child sent an unreadable message: {exc}") from exc
        if not isinstance(message, list) or len(message) != 2 or not isinstance(message[0], str):
            raise EOFError("the step child sent an unreadable message")
        return message

    def hand_over(self, ctx: StepContext, log_path: Path) -> bool:
        """Give an idle child a step; False when it is gone or does not answer (then discard it)."""
        try:
            self.greet()
            self.conn.send((ctx, str(log_path)))
            if self.conn.poll(ACK_TIMEOUT):
                kind, _ = self.recv()
                self.acked = kind == "ack"
                return self.acked
        except (EOFError, OSError):
            pass
        return False

    def discard(self, wait: float = 5.0, remove: bool = True) -> None:
        """Make sure the process is gone (it may be leaving by itself), close the pipe, remove its folder.

        ``remove=False`` keeps the folder (its step's log is still to be read); see :func:`run_in_child`.
        """
        self.retired = True
        try:
            self.conn.send(None)  # an idle child leaves at once; a dead one cannot hear it
        except OSError:
            pass
        self.proc.join(wait)
        if self.proc.is_alive():
            self.kill()
            self.proc.join()
        self.conn.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        if remove:
            self.remove_files()

    def remove_files(self) -> None:
        """Remove the child's folders and its startup output (once it is gone and its output read)."""
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)
        if self.inputs is not None:
            shutil.rmtree(self.inputs, ignore_errors=True)
        if self.startup_log is not None:
            Path(self.startup_log).unlink(missing_ok=True)

    def output_tail(self, log_path: Path, n: int) -> str:
        """Return the tail of what the child printed for its step; before it took one, of what it printed starting."""
        tail = _read_tail(log_path, n) if self.acked else ""
        if tail or self.startup_log is None:
            return tail
        return _read_tail(Path(self.startup_log), n)


#: Idle children by tenant: a child that ran a tenant's step is only ever handed that tenant's steps.
_IDLE: dict[str, list[_StepChild]] = {}
_IDLE_LOCK = threading.Lock()


def _idle_child(tenant: str) -> _StepChild | None:
    """Return an idle child of ``tenant`` (most recently used first), or None; stale ones are dropped."""
    with _IDLE_LOCK:
        idle = _IDLE.get(tenant, [])
        while idle:
            child = idle.pop()
            # Margin: a child close to its own idle limit may be leaving right now.
            if child.proc.is_alive() and time.monotonic() - child.idle_since < CHILD_IDLE_SECONDS - ACK_TIMEOUT:
                return child
            threading.Thread(target=child.discard, daemon=True).start()
    return None


def _park(child: _StepChild) -> None:
    child.idle_since = time.monotonic()
    with _IDLE_LOCK:
        _IDLE.setdefault(child.tenant, []).append(child)


def shutdown_children() -> None:
    """Stop this process's idle step children (worker shutdown; also at interpreter exit)."""
    with _IDLE_LOCK:
        children = [c for idle in _IDLE.values() for c in idle]
        _IDLE.clear()
    for child in children:
        child.discard(wait=2.0)


# Registered after multiprocessing's own exit hook, so it runs first: that hook joins
# every non-daemonic child, and an idle child would otherwise keep the worker from exiting.
atexit.register(shutdown_children)


def _read_tail(path: Path, n: int) -> str:
    """Return the last ``n`` characters of a step's log, never following a link the child put there."""
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return ""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        with os.fdopen(fd, "rb", closefd=False) as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n))
            return f.read().decode("utf-8", "replace")
    finally:
        os.close(fd)


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _children_root(settings: Settings) -> Path:
    return _VIEW.root if _VIEW is not None else settings.cache_dir / "sandbox"


def _start(settings: Settings, tenant: str) -> _StepChild:
    """Return a child for the next step of ``tenant``: an idle one of its own if any is alive, else a fresh fork."""
    idle = _idle_child(tenant)
    if idle is not None:
        return idle
    return _StepChild(_context(settings=settings), _children_root(settings), settings, tenant)


class _ChildCall:
    """Runs one step's function in a (sandboxed) child and supervises it: the executor's ``call``."""

    def __init__(
        self,
        req: StepRequest,
        child: _StepChild,
        step_dir: Path,
        redactor: Redactor,
        soft_limit: float,
        hard_limit: float,
        on_progress: Callable[[Progress], None] | None,
        tick: Callable[[], str | None] | None,
        tick_interval: float,
    ) -> None:
        self.req, self.child, self.step_dir, self.redactor = req, child, step_dir, redactor
        self.limits = (soft_limit, hard_limit)
        self.on_progress, self.tick, self.tick_interval = on_progress, tick, tick_interval
        self.log = ""

    def _context_for(self, child: _StepChild, ctx: StepContext) -> tuple[StepContext, Path]:
        """Return the step's context as ``child`` sees it, and its log: folders of its own, its inputs linked in."""
        import dataclasses

        self.step_dir = child.dir / self.step_dir.name
        out, scratch = self.step_dir / "out", self.step_dir / "scratch"
        for d in (out, scratch):
            d.mkdir(parents=True, exist_ok=True)
        changes: dict[str, Any] = {"out_dir": out, "scratch": scratch, "repository": None, "on_progress": None}
        if child.inputs is not None:  # confined: the step reads its own job's inputs, linked where it may read
            staged = StagedInputs(child.inputs / self.step_dir.name, child.dir)
            changes.update(
                source=staged.source(ctx.source),
                inputs={role: staged.artifact(art) for role, art in ctx.inputs.items()},
                extras=staged.extras(ctx.extras),
            )
        return dataclasses.replace(ctx, **changes), self.step_dir / "step.log"

    def __call__(self, ctx: StepContext) -> tuple[Artifact, dict[str, Any]]:
        child = self.child
        call_ctx, log_path = self._context_for(child, ctx)
        if not child.hand_over(call_ctx, log_path):
            gone = child
            gone.discard(remove=False)  # its folder may hold the extracted source: linked for the next first
            self.child = child = _StepChild(
                _context(settings=self.req.settings), _children_root(self.req.settings), self.req.settings, gone.tenant
            )
            call_ctx, log_path = self._context_for(child, ctx)
            gone.remove_files()
            with contextlib.suppress(EOFError, OSError):  # a child that died starting: _supervise says so
                child.greet()
                child.conn.send((call_ctx, str(log_path)))
        try:
            payload = _supervise(
                child,
                self.req,
                log_path,
                time.monotonic(),
                *self.limits,
                self._progress,
                self.tick,
                self.tick_interval,
                cpu_limit=_cpu_limit(self.req.settings),
            )
        finally:
            self.log = self.redactor.text(self.child.output_tail(log_path, STORED_LOG_CHARS))
        if not payload.get("ok"):
            raise KilnError.from_dict(self.redactor.data(payload.get("error") or {}))
        return self._claim(ctx, call_ctx.out_dir, payload), self._memory(payload.get("memory"))

    def remove_step_files(self) -> None:
        """Remove this step's folder and its linked inputs (the child stays for the next step)."""
        import shutil

        shutil.rmtree(self.step_dir, ignore_errors=True)
        if self.child.inputs is not None:
            shutil.rmtree(self.child.inputs / self.step_dir.name, ignore_errors=True)

    def _progress(self, message: Progress) -> None:
        if self.on_progress is not None:
            self.on_progress(_redacted(self.redactor, message))

    def _claim(self, ctx: StepContext, out: Path, payload: dict[str, Any]) -> Artifact:
        """Take the child's output folder back (out of its reach, links checked) as the step's artifact."""
        step_id = self.req.step["id"]
        rel = os.path.relpath(os.path.normpath(str(payload.get("root", ""))), out)
        entry = str(payload.get("entry") or "")
        if rel.startswith("..") or os.path.isabs(entry) or ".." in Path(entry).parts:
            raise ConversionFailed(f"step {step_id} reported an artifact outside its output folder", step=step_id)
        ctx.out_dir.rmdir()  # the executor's empty folder: the child's output takes its place
        claim_output(out, ctx.out_dir, step_id)
        size = sum(p.stat().st_size for p in ctx.out_dir.rglob("*") if p.is_file() and not p.is_symlink())
        limit = self.req.settings.step_max_output_bytes
        if size > limit:
            raise ConversionFailed(
                f"step {step_id} wrote {size} bytes of output, more than the {limit} a step may",
                hint="Raise KILN_STEP_MAX_OUTPUT_BYTES if artifacts this large are expected.",
                step=step_id,
            )
        meta = payload.get("meta")
        return Artifact(
            root=(ctx.out_dir / rel) if rel != "." else ctx.out_dir,
            kind=str(payload.get("kind", "")),
            entry=entry,
            meta=self.redactor.data(meta) if isinstance(meta, dict) else {},
        )

    @staticmethod
    def _memory(record: Any) -> dict[str, Any]:
        fields = ("peak_rss_mb", "rss_before_mb", "peak_rss_is_lifetime")
        if not isinstance(record, dict):
            return {}
        return {k: record[k] for k in fields if isinstance(record.get(k), (int, float, bool))}


def _redacted(redactor: Redactor, message: Progress) -> Progress:
    return redactor.data(message) if isinstance(message, dict) else redactor.text(message)


def run_in_child(
    req: StepRequest,
    *,
    soft_limit: float,
    hard_limit: float,
    on_progress: Callable[[Progress], None] | None = None,
    tick: Callable[[], str | None] | None = None,
    tick_interval: float = 1.0,
) -> ChildResult:
    """Run ``req``: its function in a child process, the rest here; wait for it. Never raises for what the step does.

    ``tick`` is called every ``tick_interval`` seconds while the child runs and may answer
    "cancel" (stop it: CANCELLED) or "lost" (stop it: another worker owns the step now).
    Publish steps load no model: they run here, where the repository's credentials are.
    """

    req.scratch.mkdir(parents=True, exist_ok=True)
    redactor = Redactor.from_settings(req.settings, os.environ)
    started = time.monotonic()
    call: _ChildCall | None = None
    work = req.scratch / "work"
    if req.step.get("kind") != "publish":
        _context(settings=req.settings)
        child = _start(req.settings, req.tenant)
        step_dir = child.dir / f"step-{os.getpid()}-{time.monotonic_ns()}"
        call = _ChildCall(req, child, step_dir, redactor, soft_limit, hard_limit, on_progress, tick, tick_interval)
        work = step_dir / "work"  # an extracted archive: where the child can read it

    def result(**kw: Any) -> ChildResult:
        pid = call.child.pid if call is not None else None
        log = call.log if call is not None else ""
        return ChildResult(seconds=time.monotonic() - started, log=log, pid=pid, **kw)

    try:
        outcome = _run(req, call, work, lambda m: on_progress(_redacted(redactor, m)) if on_progress else None)
    except _Lost:
        return result(ok=False, lost=True)
    except KilnError as exc:
        return result(ok=False, error=redactor.data(exc.to_dict()))
    except Exception as exc:  # the trusted side failed around the step (its store, its disk)
        if storage_full(exc):
            return result(ok=False, error=StorageFull(f"step {req.step['id']}: {exc}", step=req.step["id"]).to_dict())
        tail = traceback.format_exc()[-LOG_TAIL_CHARS:]
        err = ConversionFailed(
            f"step {req.step['id']} failed: {type(exc).__name__}: {exc}",
            step=req.step["id"],
            tool=req.step.get("tool", ""),
            output_tail=tail,
        )
        return result(ok=False, error=redactor.data(err.to_dict()))
    except BaseException:
        # Interrupted here (worker shutdown, a bug): the step has no one to report to any more.
        if call is not None:
            call.child.kill()
            call.child.discard()
        raise
    finally:
        if call is not None:
            # Off the step's path; a retired child's whole folder goes (its log has been read).
            if call.child.retired:
                threading.Thread(target=call.child.remove_files).start()
            else:
                threading.Thread(target=call.remove_step_files).start()
    return ChildResult(
        ok=True,
        key=outcome.key,
        cached=outcome.cached,
        seconds=outcome.seconds,
        meta=_json_safe(outcome.meta),
        log=call.log if call is not None else "",
        pid=call.child.pid if call is not None else None,
    )


def _cpu_limit(settings: Settings) -> float:
    """Return the CPU seconds one step may use (KILN_STEP_MAX_CPU_SECONDS; 0: the soft time limit times the cores)."""
    return settings.step_max_cpu_seconds or settings.step_soft_time_limit * (os.cpu_count() or 1)


def _supervise(
    child: _StepChild,
    req: StepRequest,
    log_path: Path,
    started: float,
    soft_limit: float,
    hard_limit: float,
    on_progress: Callable[[Progress], None] | None,
    tick: Callable[[], str | None] | None,
    tick_interval: float,
    cpu_limit: float | None = None,
) -> dict[str, Any]:
    """Wait for the child running ``req``'s function: relay progress, enforce limits; return its payload.

    The limits: the soft (SIGTERM) and hard (SIGKILL) time limits, and ``cpu_limit`` CPU
    seconds for this step (read from the child's /proc entry about once a second; the child's
    earlier steps do not count). Raises _Lost, CANCELLED, TIMEOUT, or CONVERSION_FAILED for a
    child that died.
    """
    proc = child.proc
    payload: dict[str, Any] | None = None
    stop_reason: str | None = None  # cancel | lost | timeout | cpu
    terminated_at: float | None = None
    next_tick = started + tick_interval
    cpu_start = child.cpu_seconds() if cpu_limit else None
    next_cpu_check = started + 1.0
    eof = False
    while payload is None:
        if eof:
            proc.join(0.1)
        else:
            try:
                if child.conn.poll(0.1):
                    kind, body = child.recv()
                    if kind == "progress" and on_progress is not None:
                        on_progress(checked_progress(body))
                    elif kind == "ack":  # a fresh child took the step (an idle one acked when handed it)
                        child.acked = True
                    elif kind == "done" and isinstance(body, dict):
                        payload = body
                        break
            except (EOFError, OSError):
                eof = True  # the child closed its end (it died), or broke the protocol
                if proc.is_alive():
                    child.kill()
        if not proc.is_alive():
            break
        now = time.monotonic()
        if tick is not None and now >= next_tick and stop_reason is None:
            next_tick = now + tick_interval
            verdict = tick()
            if verdict in ("cancel", "lost"):
                stop_reason = verdict
                child.kill()
        if cpu_start is not None and cpu_limit and stop_reason is None and now >= next_cpu_check:
            next_cpu_check = now + 1.0
            used = child.cpu_seconds()
            if used is not None and used - cpu_start > cpu_limit:
                stop_reason = "cpu"
                child.kill()
        if stop_reason is None and now - started > soft_limit:
            stop_reason, terminated_at = "timeout", now
            child.terminate()  # SIGTERM: the soft limit
        if terminated_at is not None and now - terminated_at > max(hard_limit - soft_limit, 1.0):
            child.kill()  # the hard limit
    # Drain anything sent just before the child died.
    while payload is None and not eof:
        try:
            if not child.conn.poll(0):
                break
            kind, body = child.recv()
            if kind == "done" and isinstance(body, dict):
                payload = body
            elif kind == "progress" and on_progress is not None:
                on_progress(checked_progress(body))
        except (EOFError, OSError):
            break
    if payload is not None and stop_reason is None and not payload.get("retire") and proc.is_alive():
        _park(child)  # fit for the next step
    else:
        child.discard(remove=False)
    step_id = req.step["id"]
    if stop_reason == "lost":
        raise _Lost()
    if stop_reason == "cancel":
        raise Cancelled(f"step {step_id} was stopped: its job was cancelled", step=step_id)
    if payload is not None:
        return payload
    tail = child.output_tail(log_path, LOG_TAIL_CHARS)
    if stop_reason == "timeout":
        raise Timeout(
            f"step {step_id} exceeded its time limit of {soft_limit:.0f}s and was stopped",
            step=step_id,
            output_tail=tail,
        )
    if stop_reason == "cpu":
        raise Timeout(
            f"step {step_id} used more than its {cpu_limit:.0f} CPU seconds and was stopped",
            hint="Raise KILN_STEP_MAX_CPU_SECONDS if steps this heavy are expected.",
            step=step_id,
            output_tail=tail,
        )
    code = proc.exitcode or 0
    how = f"was killed by {_signal_name(code)}" if code < 0 else f"exited with status {code}"
    if code == -signal.SIGKILL:
        how += " (out of memory, or killed from outside)"
    where = f"in {req.step.get('tool') or 'its tool'}" if child.acked else "while its step child was starting"
    raise ConversionFailed(
        f"step {step_id} crashed {where}: the process {how}",
        step=step_id,
        tool=req.step.get("tool", ""),
        exit_code=code,
        output_tail=tail,
    )
