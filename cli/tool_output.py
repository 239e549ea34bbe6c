"""Send what the engines print (TensorFlow, absl, oneDNN, NNCF, onnxruntime) to a log file.

The engines write from C++ as well as Python, straight to file descriptors 1 and 2, so
redirecting ``sys.stdout``/``sys.stderr`` is not enough: the descriptors themselves are
pointed at the log while the job runs, and restored before Kiln prints its summary.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["tool_output_to"]


@contextmanager
def tool_output_to(log: Path) -> Iterator[Path]:
    """Redirect file descriptors 1 and 2 (this process and its children) to ``log`` until exit."""
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    with open(log, "ab") as sink:
        try:
            for fd in saved:
                os.dup2(sink.fileno(), fd)
            yield log
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, orig in saved.items():
                os.dup2(orig, fd)
                os.close(orig)
