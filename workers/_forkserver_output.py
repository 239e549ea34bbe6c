"""Imported first by a worker's forkserver, and only there: each forked child writes to its own file.

See workers/startup_output.py for why. Importing this registers an ``os.fork`` hook, so
nothing but the forkserver's preload imports it.
"""

from __future__ import annotations

import os

from workers.startup_output import ROOT_ENV, startup_output

__all__ = ["OWNED"]

#: In a forked child: True once fds 1 and 2 are its own file.
OWNED = False


def _own_output() -> None:
    global OWNED
    root = os.environ.get(ROOT_ENV)
    if not root:
        return
    try:
        fd = os.open(startup_output(root, os.getpid()), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
    except OSError:
        return  # keep the forkserver's stderr rather than fail the fork
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    OWNED = True


os.register_at_fork(after_in_child=_own_output)
