"""Where a step child writes before (and between) its steps: one file per child, named by its pid.

A child does a good deal before it runs any of Kiln's code: multiprocessing prepares it
(working directory, ``sys.path``, the main module) and unpickles its target. Whatever fails
there prints a traceback on the forkserver's stderr, which is the worker's log, shared by
every child and seen by no job. So right after each fork, before any of that, the child's
fds 1 and 2 are pointed at ``<children root>/<pid>.out`` (workers/_forkserver_output.py,
imported only by the forkserver), which the worker reads when the child dies without
reporting (workers/child.py), and which the child keeps as its output between steps.

The pid is the one the forkserver got from ``fork()``, which is also what it tells the
worker, so both name the same file in whatever PID namespace the forkserver runs.
"""

from __future__ import annotations

import os

__all__ = ["ROOT_ENV", "startup_output"]

#: The children's area (the sandbox's writable root); set by the worker before the forkserver starts.
ROOT_ENV = "KILN_STEP_CHILDREN"


def startup_output(root: str | os.PathLike[str], pid: int) -> str:
    """Return the file a step child with ``pid`` writes to until (and between) its steps."""
    return os.path.join(root, f"{pid}.out")
