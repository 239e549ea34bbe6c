"""Imported first by a worker's forkserver: load the parent's main module there, once.

Each forked child re-imports the parent's ``__main__`` (the `kiln` script) unless the
forkserver already holds it under the same path. ``set_forkserver_preload(["__main__"])``
is meant to do that, but Python 3.11's forkserver never receives the main path, so the
path comes through the environment instead.
"""

from __future__ import annotations

import os

ENV = "KILN_FORKSERVER_MAIN"

_path = os.environ.get(ENV)
if _path and os.path.exists(_path):
    from multiprocessing import spawn

    spawn.import_main_path(_path)
