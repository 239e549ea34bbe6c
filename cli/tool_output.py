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

__all__ = ["tool_output_to", "tool_stdout_to_stderr"]


@contextmanager
def tool_output_to(log: Path) -> Iterator[Path]:
    """Redirect file descriptors 1 and 2 (this process and its children) to ``log`` until exit."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as sink, _descriptors_to(sink.fileno(), (1, 2)):
        yield log


@contextmanager
def tool_stdout_to_stderr() -> Iterator[None]:
    """Point descriptor 1 at descriptor 2 until exit, so stdout carries only what Kiln prints after.

    ``--json`` promises a JSON document on stdout; engines print to descriptor 1 from C++
    (paddle2onnx's "[Paddle2ONNX] Start parsing ..." came before the document and broke it).
    """
    with _descriptors_to(2, (1,)):
        yield


@contextmanager
def _descriptors_to(target: int, fds: tuple[int, ...]) -> Iterator[None]:
    """Point each of ``fds`` at descriptor ``target`` until exit, then restore them."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in fds}
    try:
        for fd in saved:
            os.dup2(target, fd)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, orig in saved.items():
            os.dup2(orig, fd)
            os.close(orig)
