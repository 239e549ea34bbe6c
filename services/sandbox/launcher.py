"""The interpreter wrapper that starts a step forkserver confined: inside bubblewrap, or with a scrubbed environment.

multiprocessing starts its forkserver with ``spawn.get_executable()``; pointing that at this
wrapper (``set_executable``) puts the forkserver, and so every step child it forks, inside
the sandbox, while forking stays as cheap as before (the engines are imported once, inside).
Namespaces: user, network (only a loopback of its own), IPC, UTS, cgroup and PID: a step sees
only the sandbox's processes, and the worker addresses each child through a pidfd the child
hands it at start (workers/child.py), never by a pid number. The root is an empty tmpfs with
the view's paths bound in (the steps' inputs area read-only); ``/proc`` is mounted only when
Landlock stops a step from reading other processes' entries there, and ``/tmp`` is private.
"""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
from pathlib import Path

from services.sandbox.protection import Protection
from services.sandbox.view import SandboxView

__all__ = ["bwrap_argv", "write_launcher"]


def bwrap_argv(bwrap: str, view: SandboxView, *, with_proc: bool) -> list[str]:
    """Return the ``bwrap`` command line (up to ``--``) that confines a process to ``view``."""
    argv = [bwrap, "--unshare-user", "--unshare-ipc", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    argv += ["--unshare-pid"]  # a step sees no process outside the sandbox (its /proc: only these)
    argv += ["--die-with-parent", "--new-session", "--tmpfs", "/", "--dev", "/dev", "--tmpfs", "/tmp"]
    argv += ["--ro-bind", "/sys", "/sys"]
    for dev in view.devices:  # after --dev: bound into the fresh /dev (a GPU worker's nodes)
        argv += ["--dev-bind", str(dev), str(dev)]
    if with_proc:
        argv += ["--proc", "/proc"]
    for p in view.read:
        if p.is_symlink() and p.parent == Path("/"):  # merged /usr: /bin -> usr/bin
            argv += ["--symlink", os.readlink(p), str(p)]
        else:
            argv += ["--ro-bind", str(p), str(p)]
    if view.inputs is not None:  # read-only: a step's inputs are links to the store's own files
        argv += ["--ro-bind", str(view.inputs), str(view.inputs)]
    for p in (view.root, *view.write):
        argv += ["--bind", str(p), str(p)]
    argv += ["--chdir", str(view.root), "--clearenv"]
    for k, v in sorted(view.env.items()):
        argv += ["--setenv", k, v]
    return argv


def write_launcher(protection: Protection, view: SandboxView, directory: Path | None = None) -> Path:
    """Write an executable that runs this Python confined as ``protection`` says; return its path."""
    python = sys.executable
    if protection.bwrap:
        prefix = [*bwrap_argv(protection.bwrap, view, with_proc=protection.landlock > 0), "--", python]
    else:  # Landlock alone: the environment is scrubbed here, the rest by each child's ruleset
        prefix = ["env", "-i", *(f"{k}={v}" for k, v in sorted(view.env.items())), python]
    directory = Path(directory or tempfile.mkdtemp(prefix="kiln-sandbox-"))
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "python"
    script.write_text("#!/bin/sh\nexec " + " ".join(shlex.quote(a) for a in prefix) + ' "$@"\n')
    script.chmod(0o755)
    return script
