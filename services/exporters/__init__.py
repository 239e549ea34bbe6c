"""Exporters: the last step per target. Each writes the engine-native artifact at the
job's precision, runs it on its engine against the reference, benchmarks it, and describes
how the repository should serve it."""
