"""Stand-in for the old ``tests/models.py`` while bench_tune.py still imports ``models``.

The models moved to :mod:`kiln_testing.models`. bench_tune.py is being changed on another
branch, so it was left alone here; once it imports ``kiln_testing.models``, delete this file.
"""

from kiln_testing.models import export_onnx, tiny_transformer_module

__all__ = ["export_onnx", "tiny_transformer_module"]
