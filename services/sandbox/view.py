"""What a confined step sees: the paths it may read, the ones it may write, and its environment.

The same view drives both layers: bubblewrap binds exactly these paths (read-only, or
read-write for the children's area and the host's benchmark locks) into an otherwise empty
root, and each step process's Landlock ruleset allows reading them and writing only its own
directory. So a file the worker can read (a mounted secret, ``~/.aws``, another job's
upload) is simply absent from a step, whichever layer the host allows. The artifact store
and the fetch cache are not in it: the worker links the inputs of each step into that step
process's own folder of the inputs area (read-only to it), so a step sees its own job's
inputs and nothing of the others'.

A worker whose engine runs on a GPU (its descriptor's image asks for one) also gets the GPU's
device nodes (``/dev/nvidia*``): bubblewrap's fresh ``/dev`` holds only null, zero, random
and the like, and CUDA opens the driver's control, UVM and per-GPU nodes, so without them a
sandboxed GPU step saw no device at all. Only device nodes that exist on the host are bound,
each one by name; Landlock allows reading, writing and ioctl on exactly those.

The environment is an allowlist: locale, thread counts and the engines' log levels pass;
everything else (``KILN_S3_*``, ``KILN_DATABASE_URL``, ``KILN_BROKER_URL``, ``AWS_*``,
tokens) does not. Tests name extra variables and writable paths in ``KILN_SANDBOX_ENV``
and ``KILN_SANDBOX_WRITABLE``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["GPU_DEVICE_PATTERNS", "SandboxView", "gpu_devices", "sandbox_env", "sandbox_view"]

#: Environment variables a step keeps (exact names, then prefixes).
_ENV_NAMES = frozenset(
    {"PATH", "LANG", "LANGUAGE", "TZ", "PYTHONPATH", "PYTHONHASHSEED", "PYTHONUNBUFFERED", "TF_CPP_MIN_LOG_LEVEL",
     "TF_ENABLE_ONEDNN_OPTS", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES",
     "KILN_HOST_LOCK_DIR", "KILN_BENCH_QUIET_WAIT", "KILN_FORKSERVER_MAIN", "KILN_STEP_CHILDREN",
     "KILN_DEBUG", "KILN_TVM_TUNING_DIR", "KILN_TVM_DEFAULT_TRIALS", "TVM_NUM_THREADS"}
)  # fmt: skip
_ENV_PREFIXES = ("LC_", "OMP_", "MKL_", "OPENBLAS_", "KMP_")
#: Kiln's own top-level packages: an editable install finds them through an import hook
#: (setuptools' finder), not through a ``sys.path`` entry, so their folders are named here.
_KILN_PACKAGES = ("services", "workers", "cli", "api")
#: Files of /etc the loader and Python need (never the whole directory: secrets get mounted there).
#: The device nodes NVIDIA's driver gives CUDA (what the container toolkit passes into a GPU
#: container): the control node, UVM, each GPU, modeset, and the capability nodes of MIG.
GPU_DEVICE_PATTERNS = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset",
                       "/dev/nvidia[0-9]*", "/dev/nvidia-caps/nvidia-cap*")  # fmt: skip
_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "passwd", "group", "nsswitch.conf", "localtime",
        "alternatives", "os-release", "hosts", "mime.types")  # fmt: skip


@dataclass(frozen=True)
class SandboxView:
    """Paths a confined step may read and write, and the environment it starts with."""

    root: Path  # the children's area: each step process writes only below its own folder here
    read: tuple[Path, ...]  # read-only (bubblewrap binds them; Landlock allows reading them)
    write: tuple[Path, ...]  # read-write besides the process's own folder (the host's benchmark locks)
    env: dict[str, str] = field(default_factory=dict)
    #: The steps' inputs: bound read-only by bubblewrap, and each step process's Landlock rules
    #: allow reading only its own folder in it (workers/child.py links a step's inputs there).
    inputs: Path | None = None
    #: Device nodes bound in read-write (a GPU worker's, see ``gpu_devices``); Landlock allows
    #: reading, writing and ioctl on each.
    devices: tuple[Path, ...] = ()

    def covers(self, other: SandboxView) -> bool:
        """True when everything ``other`` needs is in this view (a running sandbox can serve it)."""
        return (
            self.root == other.root
            and self.inputs == other.inputs
            and set(other.read) <= set(self.read)
            and set(other.write) <= set(self.write)
            and set(other.devices) <= set(self.devices)
            and other.env == self.env
        )


def gpu_devices(patterns: Iterable[str] = GPU_DEVICE_PATTERNS) -> tuple[Path, ...]:
    """Return the character devices on this host that match ``patterns`` (globs of absolute paths), sorted."""
    import glob
    import stat

    found: set[Path] = set()
    for pattern in patterns:
        for name in glob.glob(pattern):
            try:
                if stat.S_ISCHR(os.stat(name).st_mode):
                    found.add(Path(name))
            except OSError:
                continue  # gone between the glob and the stat
    return tuple(sorted(found))


def sandbox_env(environ: Mapping[str, str]) -> dict[str, str]:
    """Return the part of ``environ`` a step keeps (see the module docstring)."""
    extra = {n.strip() for n in environ.get("KILN_SANDBOX_ENV", "").split(",") if n.strip()}
    keep = {k: v for k, v in environ.items() if k in _ENV_NAMES or k in extra or k.startswith(_ENV_PREFIXES)}
    keep.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    keep["PYTHONDONTWRITEBYTECODE"] = "1"
    keep["HOME"] = "/nonexistent"  # each step sets HOME and TMPDIR to its own scratch
    return keep


def _python_paths() -> list[Path]:
    paths = {Path(sys.base_prefix), Path(sys.prefix), Path(sys.exec_prefix)}
    for p in sys.path:
        if p and Path(p).exists():
            paths.add(Path(p).resolve())
    for name in _KILN_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            paths.update(Path(p).resolve() for p in spec.submodule_search_locations)
    exe = Path(sys.executable)
    paths.add(exe.parent)
    paths.add(exe.resolve().parent)
    main = os.environ.get("KILN_FORKSERVER_MAIN") or getattr(sys.modules.get("__main__"), "__file__", None)
    if main and Path(main).exists():
        paths.add(Path(main).resolve())
    return sorted(paths)


def _minimal(paths: Iterable[Path]) -> tuple[Path, ...]:
    """Return ``paths`` without those already inside another one of them, sorted."""
    ordered = sorted({Path(os.path.abspath(p)) for p in paths if Path(p).exists()}, key=lambda p: len(p.parts))
    kept: list[Path] = []
    for p in ordered:
        if not any(p == k or k in p.parents for k in kept):
            kept.append(p)
    return tuple(sorted(kept))


def sandbox_view(
    root: Path,
    *,
    read: Iterable[Path] = (),
    environ: Mapping[str, str] | None = None,
    inputs: Path | None = None,
    devices: Iterable[Path] = (),
) -> SandboxView:
    """Return the view of steps whose folders live under ``root`` and that read ``read`` besides the system.

    ``inputs``: the folder the worker links each step's inputs into (one subfolder per step
    process); never the artifact store or the fetch cache themselves. ``devices``: device
    nodes the steps use (a GPU worker's: ``gpu_devices()``).
    """
    environ = os.environ if environ is None else environ
    system = [Path(p) for p in ("/usr", "/bin", "/lib", "/lib64", "/sbin", "/opt/kiln")]
    system += [Path("/etc") / name for name in _ETC]
    lock_dir = Path(environ.get("KILN_HOST_LOCK_DIR") or f"/tmp/kiln-host-{os.getuid()}")
    lock_dir.mkdir(parents=True, exist_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    # The TVM tuning database steps share (services/tvm/_tuning.py: one folder per tuned kernel).
    tuning_dir = Path(environ.get("KILN_TVM_TUNING_DIR") or f"/var/tmp/kiln-tvm-tuning-{os.getuid()}")
    writable = [lock_dir, tuning_dir] + [
        Path(p) for p in environ.get("KILN_SANDBOX_WRITABLE", "").split(os.pathsep) if p
    ]
    for p in writable:
        p.mkdir(parents=True, exist_ok=True)
    if inputs is not None:
        inputs.mkdir(parents=True, exist_ok=True)
    kept = (root, *((inputs,) if inputs is not None else ()))
    reads = [p for p in _minimal([*system, *_python_paths(), *read]) if not any(p == k or k in p.parents for k in kept)]
    env = {**sandbox_env(environ), "KILN_TVM_TUNING_DIR": str(tuning_dir)}  # the step finds the folder bound here
    return SandboxView(
        root=root,
        read=tuple(reads),
        write=_minimal(writable),
        env=env,
        inputs=inputs,
        devices=tuple(sorted({Path(d) for d in devices})),
    )
