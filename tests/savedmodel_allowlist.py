"""Review services/formats/savedmodel_ops.py, the ops a vetted SavedModel may use, against this TensorFlow.

The allowlist is reviewed op by op, not generated: this script only reports what a reviewer
must look at after a TensorFlow upgrade (``python tests/savedmodel_allowlist.py``):

- ops in the list that the installed TensorFlow does not register any more;
- ops in the list with an attribute or input whose name says it names a file, a path, a
  memory region or a module (``vocab_file``, ``memory_region_name``, ``filename``...);
- TensorFlow's ops that are neither in the list nor in its reviewed refusals (new ops to review).

tests/test_model_vetting.py fails on the first two (``problems()``).
"""

from __future__ import annotations

import re

#: Names of attributes and inputs that point outside the graph (files, devices, libraries, hosts).
_REACHING = re.compile(
    r"(^|_)(file|files|filename|filenames|filepath|path|dir|directory|logdir|region|url|address|library|module)(_|$)",
    re.I,
)


def _op_defs() -> dict[str, object]:
    """Return every op the installed TensorFlow registers, by name (its OpDef)."""
    import tensorflow  # noqa: F401 - registers the ops
    from tensorflow.core.framework import op_def_pb2
    from tensorflow.python.client import pywrap_tf_session

    ops = op_def_pb2.OpList()
    buffer = pywrap_tf_session.TF_GetAllOpList()
    try:
        ops.ParseFromString(pywrap_tf_session.TF_GetBuffer(buffer))
    finally:
        pywrap_tf_session.TF_DeleteBuffer(buffer)
    return {op.name: op for op in ops.op}


def reaching_arguments(op_def: object) -> list[str]:
    """Return the attributes and inputs of ``op_def`` whose names say they reach outside the graph."""
    found = [f"attr {a.name}" for a in op_def.attr if _REACHING.search(a.name)]  # type: ignore[attr-defined]
    found += [f"input {i.name}" for i in op_def.input_arg if _REACHING.search(i.name)]  # type: ignore[attr-defined]
    return found


def problems() -> dict[str, list[str]]:
    """Return the allowlist's problems under the installed TensorFlow: {op: reasons}."""
    from services.formats.savedmodel_ops import ALLOWED_TF_OPS

    defs = _op_defs()
    out: dict[str, list[str]] = {}
    for op in sorted(ALLOWED_TF_OPS):
        if op not in defs:
            out[op] = ["not registered by this TensorFlow"]
        elif reaching := reaching_arguments(defs[op]):
            out[op] = reaching
    return out


def unreviewed() -> list[str]:
    """Return TensorFlow's ops that the allowlist neither admits nor names as refused (internal ``_`` ops aside)."""
    from services.formats.savedmodel_ops import ALLOWED_TF_OPS

    return sorted(op for op in _op_defs() if op not in ALLOWED_TF_OPS and not op.startswith("_"))


if __name__ == "__main__":
    for op, reasons in problems().items():
        print(f"PROBLEM {op}: {', '.join(reasons)}")
    print(f"{len(unreviewed())} ops of this TensorFlow are not allowed (review new ones before adding them)")
