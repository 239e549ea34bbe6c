"""Converters: one module per family of edges in the converter graph (format -> format)."""
