"""Build services/formats/savedmodel_ops.py, the TensorFlow ops a vetted SavedModel may use, from this TensorFlow.

Run it after a TensorFlow upgrade (``python tests/savedmodel_allowlist.py >
services/formats/savedmodel_ops.py``); tests/test_savedmodel_vetting.py fails while the
committed list and the installed TensorFlow disagree. TensorFlow's Python wrappers are
generated one module per op family (``gen_math_ops``, ``gen_io_ops``, ...), which is the
grouping used here: the families that only compute on tensors are allowed whole, minus the
few ops in them that reach a file, and every other family (files, logging and summaries,
Python callbacks, tf.data, RPC and collectives, debuggers, TPU, XLA modules) is left out.
"""

from __future__ import annotations

import re
from pathlib import Path

#: Op families whose ops compute on tensors in the process (variables, control flow and
#: functions included).
ALLOWED_FAMILIES = (
    "gen_array_ops", "gen_audio_ops", "gen_batch_ops", "gen_bitwise_ops", "gen_boosted_trees_ops",
    "gen_candidate_sampling_ops", "gen_clustering_ops", "gen_composite_tensor_ops", "gen_control_flow_ops",
    "gen_count_ops", "gen_ctc_ops", "gen_cudnn_rnn_ops", "gen_data_flow_ops", "gen_functional_ops",
    "gen_image_ops", "gen_linalg_ops", "gen_list_ops", "gen_lookup_ops", "gen_manip_ops", "gen_map_ops",
    "gen_math_ops", "gen_nn_ops", "gen_optional_ops", "gen_parsing_ops", "gen_ragged_array_ops",
    "gen_ragged_conversion_ops", "gen_ragged_math_ops", "gen_random_index_shuffle_ops", "gen_random_ops",
    "gen_resource_variable_ops", "gen_rnn_ops", "gen_sdca_ops", "gen_set_ops", "gen_sparse_csr_matrix_ops",
    "gen_sparse_ops", "gen_special_math_ops", "gen_spectral_ops", "gen_state_ops", "gen_stateful_random_ops",
    "gen_stateless_random_ops", "gen_stateless_random_ops_v2", "gen_string_ops", "gen_training_ops",
    "gen_uniform_quant_ops",
)  # fmt: skip
#: Ops of the allowed families that read a file or run elsewhere than this process.
DENIED_IN_ALLOWED = frozenset(
    {
        "RemoteCall",  # runs a function on another (possibly remote) device
        "RecordInput",  # reads the records of files matching a pattern
        "InitializeTableFromTextFile",  # read a vocabulary file named by a tensor
        "InitializeTableFromTextFileV2",
    }
)
#: From the logging family only Assert: it fails the call with a message and prints nothing.
ALLOWED_FROM_DENIED = frozenset({"Assert"})

_OP = re.compile(r'_apply_op_helper\(\s*"([A-Za-z0-9_]+)"')


def families() -> dict[str, set[str]]:
    """Return each generated op family of the installed TensorFlow and the op names in it."""
    import tensorflow as tf

    root = Path(tf.__file__).parent
    found: dict[str, set[str]] = {}
    for path in sorted(root.rglob("gen_*.py")):
        found.setdefault(path.stem, set()).update(_OP.findall(path.read_text()))
    return found


def allowed_ops() -> dict[str, list[str]]:
    """Return the allowed op names by family (ALLOWED_FROM_DENIED under "exceptions")."""
    fams = families()
    out = {f: sorted(fams.get(f, set()) - DENIED_IN_ALLOWED) for f in ALLOWED_FAMILIES}
    out["exceptions"] = sorted(ALLOWED_FROM_DENIED)
    return out


def render() -> str:
    import tensorflow as tf

    lines = [
        f'"""TensorFlow ops a vetted SavedModel may use (generated from TensorFlow {tf.__version__} by',
        "tests/savedmodel_allowlist.py; do not edit by hand).",
        "",
        "Families allowed whole: " + ", ".join(f.removeprefix("gen_") for f in ALLOWED_FAMILIES) + ";",
        f"minus {', '.join(sorted(DENIED_IN_ALLOWED))}; plus {', '.join(sorted(ALLOWED_FROM_DENIED))}.",
        '"""',
        "",
        '__all__ = ["ALLOWED_TF_OPS", "TF_VERSION"]',
        "",
        f'TF_VERSION = "{tf.__version__}"',
        "",
        "ALLOWED_TF_OPS = frozenset(",
        "    {",
    ]
    for family, ops in allowed_ops().items():
        lines.append(f"        # {family}")
        lines.extend(f'        "{op}",' for op in ops)
    lines += ["    }", ")", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(), end="")
