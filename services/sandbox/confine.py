"""The Landlock ruleset a step process applies to itself right after it is forked.

Landlock (Linux's unprivileged sandboxing LSM, through the ``landlockpy`` binding: it
degrades to what the running kernel supports) restricts the calling process and its future
children for good: reading only the view's paths and its own folder, writing only its own
folder (plus the benchmark locks, the null device and the view's device nodes), no TCP bind or connect (ABI 4+), and
no signals to or abstract unix sockets of processes outside it (ABI 6+). Landlock also keeps
it from tracing, or reading ``/proc/<pid>/environ`` and ``mem`` of, any process outside its
domain: the worker, the forkserver and the other steps.
"""

from __future__ import annotations

from pathlib import Path

from services.sandbox.view import SandboxView

__all__ = ["confine_self"]


def confine_self(view: SandboxView, own: Path, own_inputs: Path | None = None) -> int:
    """Restrict this process to ``view`` with ``own`` as its only folder; return the ABI applied (0: none).

    ``own_inputs``: this process's folder of the inputs area, the only part of it it may read.
    """
    import landlockpy
    from landlockpy import AccessFS, AccessNet, Ruleset, Scope

    abi = landlockpy.abi_version()
    if abi < 1:
        return 0
    own.mkdir(parents=True, exist_ok=True)
    read = AccessFS.READ_FILE | AccessFS.READ_DIR | AccessFS.EXECUTE
    write = landlockpy.fs_for_abi(abi) & ~AccessFS.EXECUTE
    # A rule on a file may carry only the rights that apply to files.
    on_file = AccessFS.EXECUTE | AccessFS.READ_FILE | AccessFS.WRITE_FILE | AccessFS.TRUNCATE | AccessFS.IOCTL_DEV

    def allow(rules: Ruleset, path: Path, access: AccessFS) -> None:
        if path.exists():
            rules.allow_path(path, access if path.is_dir() else access & on_file)

    with Ruleset(
        handled_net=AccessNet.BIND_TCP | AccessNet.CONNECT_TCP,
        scoped=Scope.ABSTRACT_UNIX_SOCKET | Scope.SIGNAL,
    ) as rules:
        for p in (*view.read, *((own_inputs,) if own_inputs is not None else ()), Path("/proc"), Path("/sys")):
            allow(rules, p, read)
        allow(rules, Path("/dev"), read)
        for p in (own, *view.write, Path("/dev/shm")):
            allow(rules, p, read | write)
        for dev in ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random"):
            allow(rules, Path(dev), AccessFS.READ_FILE | AccessFS.WRITE_FILE)
        for node in view.devices:  # a GPU's nodes: the driver is driven by ioctl (ABI 5+ handles it)
            allow(rules, node, (read | write) & on_file & ~AccessFS.EXECUTE)
        rules.restrict()
    return abi
