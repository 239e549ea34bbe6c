"""Imported last by a worker's forkserver: fill caches every step child would rebuild, freeze the heap.

- The tool versions go into every step's cache key and manifest; reading them from the
  installed distributions' metadata costs ~15 ms per engine, which each forked child would
  otherwise pay on its first step.
- ``gc.freeze()`` moves everything imported so far out of the collector's sight: a child's
  collections then scan only what its steps allocate (a full collection over the preloaded
  engines takes tens of milliseconds), and do not touch, so copy, the shared pages.

Nothing here starts a thread or touches an engine runtime, so forking afterwards stays safe.
"""

from __future__ import annotations

import gc

from services.graph.engines import ENGINES
from services.versions import tool_versions

__all__: list[str] = []

for _engine in ENGINES:
    tool_versions(_engine)

gc.collect()
gc.freeze()
