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
from services.sandbox import Protection, Redactor, SandboxView, host_protection, sandbox_view
from services.sandbox.outputs import claim_output
from services.settings import Settings
from services.steps.context import Progress, StepContext
from services.storage.base import ArtifactStore

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
    use_cache: bool = True
    # What the API detected and hashed at upload; with them a plain-file source is not read
    # again by every step (hashing a 1 GiB model takes seconds).
    source_format: str | None = None
    source_sha256: str | None = None
    source_seen: str = ""
    route_attempts: list[dict[str, Any]] | None = None  # publish steps: for the manifest


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
#: The protection this process's step children get, and the view its forkserver was started with.
_PROTECTION: Protection | None = None
_VIEW: SandboxView | None = None
_SANDBOX_LOCK = threading.Lock()


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
    if settings is not None:
        _ensure_sandbox(settings)
    return _CONTEXT


def _step_reads(settings: Settings) -> list[Path]:
    """Return the folders a step reads its inputs from: the host's fetch cache and a local store."""
    reads = [settings.cache_dir / "worker-fetch"]
    if not settings.store_location.startswith("s3://"):
        reads.append(Path(settings.store_location))
    for p in reads:
        p.mkdir(parents=True, exist_ok=True)
    return reads


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
        view = sandbox_view(root, read=[*(_VIEW.read if _VIEW else ()), *_step_reads(settings)])
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


def _redirect_output(log_path: Path | None) -> None:
    """Point fds 1 and 2 (so Python, C libraries and faulthandler alike) at ``log_path``, or /dev/null."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
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


def _child_loop(conn: Any, own: str | None = None, view: SandboxView | None = None, landlock: bool = False) -> None:
    """Body of a step child: confine itself to ``own``, then run the steps the parent sends until told to retire."""
    _die_with_parent()
    _redirect_output(None)
    _own_output()
    if own is not None:
        Path(own).mkdir(parents=True, exist_ok=True)
        os.chdir(own)
        if landlock and view is not None:
            from services.sandbox.confine import confine_self

            confine_self(view, Path(own))
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
    override), so it is taken as recorded; archives go through open_source, which extracts
    (and vets) them, with the hash recorded at upload.
    """
    from services.formats import DetectedSource, Format, open_source
    from services.formats.archives import archive_kind

    if req.source_format and req.source_sha256 and path.is_file() and archive_kind(path) is None:
        return DetectedSource(
            format=Format(req.source_format), path=path, seen=req.source_seen, sha256=req.source_sha256
        )
    sha = req.source_sha256 if path.is_file() else None
    return open_source(path, work, override, sha256=sha, vet=req.settings.vet_uploads)


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


class _StepChild:
    """A child process, the parent's end of its pipe and the folder it may write."""

    def __init__(self, ctx: Any, root: Path) -> None:
        import uuid

        self.conn, theirs = ctx.Pipe(duplex=True)
        self.dir = root / f"child-{uuid.uuid4().hex[:12]}"
        confined = _VIEW is not None and _PROTECTION is not None and _PROTECTION.confined
        landlock = bool(_PROTECTION and _PROTECTION.landlock and _VIEW is not None)
        args = (theirs, str(self.dir), _VIEW if confined else None, landlock)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc = ctx.Process(target=_child_loop, args=args, name="kiln-step")
        self.proc.start()
        theirs.close()
        self.idle_since = time.monotonic()
        self.retired = False

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
            self.conn.send((ctx, str(log_path)))
            if self.conn.poll(ACK_TIMEOUT):
                kind, _ = self.recv()
                return bool(kind == "ack")
        except (EOFError, OSError):
            pass
        return False

    def discard(self, wait: float = 5.0, remove: bool = True) -> None:
        """Make sure the process is gone (it may be leaving by itself), close the pipe, remove its folder.

        ``remove=False`` keeps the folder (its step's log is still to be read); see :func:`run_in_child`.
        """
        import shutil

        self.retired = True
        try:
            self.conn.send(None)  # an idle child leaves at once; a dead one cannot hear it
        except OSError:
            pass
        self.proc.join(wait)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()
        if remove:
            shutil.rmtree(self.dir, ignore_errors=True)


_IDLE: list[_StepChild] = []
_IDLE_LOCK = threading.Lock()


def _idle_child() -> _StepChild | None:
    """Return an idle child (most recently used first), or None; stale ones are dropped."""
    with _IDLE_LOCK:
        while _IDLE:
            child = _IDLE.pop()
            # Margin: a child close to its own idle limit may be leaving right now.
            if child.proc.is_alive() and time.monotonic() - child.idle_since < CHILD_IDLE_SECONDS - ACK_TIMEOUT:
                return child
            threading.Thread(target=child.discard, daemon=True).start()
    return None


def _park(child: _StepChild) -> None:
    child.idle_since = time.monotonic()
    with _IDLE_LOCK:
        _IDLE.append(child)


def shutdown_children() -> None:
    """Stop this process's idle step children (worker shutdown; also at interpreter exit)."""
    with _IDLE_LOCK:
        children, _IDLE[:] = list(_IDLE), []
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


def _start(settings: Settings) -> _StepChild:
    """Return a child for the next step: an idle one if any is alive, else a fresh fork."""
    idle = _idle_child()
    return idle if idle is not None else _StepChild(_context(settings=settings), _children_root(settings))


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

    def __call__(self, ctx: StepContext) -> tuple[Artifact, dict[str, Any]]:
        import dataclasses

        out, scratch, log_path = self.step_dir / "out", self.step_dir / "scratch", self.step_dir / "step.log"
        for d in (out, scratch):
            d.mkdir(parents=True, exist_ok=True)
        call_ctx = dataclasses.replace(ctx, out_dir=out, scratch=scratch, repository=None, on_progress=None)
        child = self.child
        if not child.hand_over(call_ctx, log_path):
            child.discard()
            child = self.child = _StepChild(_context(settings=self.req.settings), _children_root(self.req.settings))
            child.conn.send((call_ctx, str(log_path)))
        try:
            payload = _supervise(
                child, self.req, log_path, time.monotonic(), *self.limits, self._progress, self.tick, self.tick_interval
            )
        finally:
            self.log = self.redactor.text(_read_tail(log_path, STORED_LOG_CHARS))
        if not payload.get("ok"):
            raise KilnError.from_dict(self.redactor.data(payload.get("error") or {}))
        return self._claim(ctx, out, payload), self._memory(payload.get("memory"))

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
    import shutil

    req.scratch.mkdir(parents=True, exist_ok=True)
    redactor = Redactor.from_settings(req.settings, os.environ)
    started = time.monotonic()
    call: _ChildCall | None = None
    work = req.scratch / "work"
    if req.step.get("kind") != "publish":
        _context(settings=req.settings)
        child = _start(req.settings)
        step_dir = child.dir / f"step-{os.getpid()}-{time.monotonic_ns()}"
        call = _ChildCall(req, child, step_dir, redactor, soft_limit, hard_limit, on_progress, tick, tick_interval)
        work = step_dir / "work"  # an extracted archive: where the child can read it

    def result(**kw: Any) -> ChildResult:
        pid = call.child.proc.pid if call is not None else None
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
            call.child.proc.kill()
            call.child.discard()
        raise
    finally:
        if call is not None:
            # Off the step's path; a retired child's whole folder goes (its log has been read).
            gone = call.child.dir if call.child.retired else call.step_dir
            threading.Thread(target=shutil.rmtree, args=(gone,), kwargs={"ignore_errors": True}).start()
    return ChildResult(
        ok=True,
        key=outcome.key,
        cached=outcome.cached,
        seconds=outcome.seconds,
        meta=_json_safe(outcome.meta),
        log=call.log if call is not None else "",
        pid=call.child.proc.pid if call is not None else None,
    )


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
) -> dict[str, Any]:
    """Wait for the child running ``req``'s function: relay progress, enforce limits; return its payload.

    Raises _Lost, CANCELLED, TIMEOUT, or CONVERSION_FAILED for a child that died.
    """
    proc = child.proc
    payload: dict[str, Any] | None = None
    stop_reason: str | None = None  # cancel | lost | timeout
    terminated_at: float | None = None
    next_tick = started + tick_interval
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
                    elif kind == "done" and isinstance(body, dict):
                        payload = body
                        break
            except (EOFError, OSError):
                eof = True  # the child closed its end (it died), or broke the protocol
                if proc.is_alive():
                    proc.kill()
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
    tail = _read_tail(log_path, LOG_TAIL_CHARS)
    if stop_reason == "timeout":
        raise Timeout(
            f"step {step_id} exceeded its time limit of {soft_limit:.0f}s and was stopped",
            step=step_id,
            output_tail=tail,
        )
    code = proc.exitcode or 0
    how = f"was killed by {_signal_name(code)}" if code < 0 else f"exited with status {code}"
    if code == -signal.SIGKILL:
        how += " (out of memory, or killed from outside)"
    raise ConversionFailed(
        f"step {step_id} crashed in {req.step.get('tool') or 'its tool'}: the process {how}",
        step=step_id,
        tool=req.step.get("tool", ""),
        exit_code=code,
        output_tail=tail,
    )
