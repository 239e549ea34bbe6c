"""The one decision "this model was vetted as this format", for submission and the worker alike.

:func:`vet_source` runs the vetter the format's descriptor names (``FormatDescriptor.vet``) on
the path its loader will open, and nothing else decides that a model passed. Three rules:

- the format vetted is the format loaded: a ``source_format`` the spec forces is vetted as
  that format (never as what detection saw), and the :class:`~services.formats.DetectedSource`
  records the format it was vetted as, which the worker checks before any step reads it;
- a vetter's failure is a refusal: UNSAFE_INPUT and SOURCE_UNREADABLE (and any other Kiln
  error) go to the user as they are, and anything else a vetter raises becomes
  SOURCE_UNREADABLE. No caller catches a vetter's error to carry on;
- ``enabled=False`` (``KILN_VET_UPLOADS=false``, refused in production, used by the sandbox's
  tests) is the only way past, and the source then says it was not vetted.

Formats whose loaders vet as they read (Keras' config walk, torch.export's archive check, the
``loadable`` hooks of Caffe, Hugging Face and Paddle, which vet while resolving the path)
have that check at the same place for both sides, because the worker opens sources with the
same :func:`services.formats.open_source`.
"""

from __future__ import annotations

import importlib
import threading
from collections import OrderedDict
from pathlib import Path

from services.descriptors import registry
from services.errors import KilnError, SourceUnreadable

__all__ = ["NOT_VETTED", "vet_source"]

#: What a source records when vetting was switched off (KILN_VET_UPLOADS=false).
NOT_VETTED = "off"

_HINT = "Kiln could not check this model before loading it, so it does not load it; export it again with its framework."
#: Plain files already vetted by this process: (sha256, format) -> True. A worker opens the same
#: upload for every step of a job; its content address makes the answer reusable.
_MEMO: OrderedDict[tuple[str, str], bool] = OrderedDict()
_MEMO_SIZE = 256
_MEMO_LOCK = threading.Lock()


def _vetter(fmt: str) -> str | None:
    return registry().formats[fmt].vet


def vet_source(fmt: str, loadable: Path, *, sha256: str | None = None, enabled: bool = True) -> str:
    """Vet ``loadable`` as format ``fmt``; return what the source records (``fmt``, or :data:`NOT_VETTED`).

    Raises the vetter's refusal (UNSAFE_INPUT, SOURCE_UNREADABLE, ...), and SOURCE_UNREADABLE for
    anything else it raised. ``sha256`` (of a plain file) lets a process skip a file it vetted before.
    """
    if not enabled:
        return NOT_VETTED
    entry = _vetter(fmt)
    if entry is None:
        return fmt
    key = (sha256, fmt) if sha256 and loadable.is_file() else None
    if key is not None:
        with _MEMO_LOCK:
            if key in _MEMO:
                _MEMO.move_to_end(key)
                return fmt
    module, _, func = entry.partition(":")
    try:
        getattr(importlib.import_module(module), func)(loadable)
    except KilnError:
        raise
    except Exception as exc:  # a vetter that cannot read what it was given refuses it
        raise SourceUnreadable(
            f"{loadable.name} could not be checked as {fmt}: {type(exc).__name__}: {str(exc)[:300]}",
            hint=_HINT,
            format=fmt,
        ) from exc
    if key is not None:
        with _MEMO_LOCK:
            _MEMO[key] = True
            while len(_MEMO) > _MEMO_SIZE:
                _MEMO.popitem(last=False)
    return fmt
