"""Numeric validation: parity inputs, and comparison of an artifact with its source."""

from services.validation.inputs import load_calibration, make_validation_inputs, resolve_shape
from services.validation.parity import OutputParity, ParityReport, check_parity, compare_outputs

__all__ = [
    "OutputParity",
    "ParityReport",
    "check_parity",
    "compare_outputs",
    "load_calibration",
    "make_validation_inputs",
    "resolve_shape",
]
