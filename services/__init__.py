"""Kiln's shared library: formats, spec, converter graph, passes, exporters, validation,
benchmarks, artifact store and model repository. Imports neither FastAPI nor Celery."""

__version__ = "0.1.0"
