"""The CompileSpec from `kiln compile`'s flags: the same for a local run and a run on a server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.errors import InvalidSpec

__all__ = ["evaluation_flags", "parse_input_flag", "spec_from_flags"]


def parse_input_flag(text: str) -> tuple[str, dict[str, Any]]:
    """Return ``(name, InputSpec fields)`` from ``NAME:SHAPE`` or ``NAME:MIN,OPT,MAX`` (shapes as 1x3x224x224)."""
    name, sep, shapes = text.rpartition(":")
    hint = "Write --input NAME:1x3x224x224 (-1 keeps an axis open) or NAME:MIN,OPT,MAX, e.g. x:1x3x224x224,8x3x224x224,32x3x224x224."
    try:
        if not sep or not name:
            raise ValueError("no NAME:")
        dims = [[int(d) for d in shape.lower().split("x")] for shape in shapes.split(",")]
    except ValueError:
        raise InvalidSpec(f"--input {text!r} is not NAME:SHAPE", hint=hint) from None
    if len(dims) == 1:
        return name, {"shape": dims[0]}
    if len(dims) == 3:
        return name, {"min": dims[0], "opt": dims[1], "max": dims[2]}
    raise InvalidSpec(f"--input {text!r} gives {len(dims)} shapes; one, or three (min,opt,max)", hint=hint)


def spec_from_flags(
    spec_file: Path | None,
    targets: tuple[str, ...],
    precision: str | None,
    name: str | None,
    calibration: Path | None,
    version: int | None,
    no_benchmark: bool,
    inputs: tuple[str, ...] = (),
    max_batch_size: int | None = None,
    serving_root: str | None = None,
    *,
    evaluation: Path | None = None,
    eval_metric: str | None = None,
    eval_output: str | None = None,
    max_drop: float | None = None,
) -> dict[str, Any]:
    """Return the spec as JSON data: the ``--spec`` file's, with the flags over it (not validated yet)."""
    try:
        data: dict[str, Any] = json.loads(spec_file.read_text()) if spec_file else {}
    except json.JSONDecodeError as exc:
        raise InvalidSpec(f"{spec_file} is not JSON: {exc}", hint="--spec takes a CompileSpec as JSON.") from None
    if not isinstance(data, dict):
        raise InvalidSpec(f"{spec_file} holds no JSON object", hint="--spec takes a CompileSpec as JSON.")
    for flag in inputs:
        input_name, fields = parse_input_flag(flag)
        data.setdefault("inputs", {})[input_name] = fields
    if max_batch_size is not None:
        data["max_batch_size"] = max_batch_size
    if serving_root:
        data.setdefault("serving", {})["root"] = serving_root
    if targets:
        data["targets"] = list(targets)
    if precision:
        data["precision"] = precision
    if name:
        data["name"] = name
    if version:
        data["version"] = version
    if calibration:
        data["calibration"] = str(calibration)
    if no_benchmark:
        data["benchmark"] = False
    evaluation_flags(data, evaluation, eval_metric, eval_output, max_drop)
    return data


def evaluation_flags(
    data: dict[str, Any],
    evaluation: Path | None,
    metric: str | None,
    output: str | None,
    max_drop: float | None,
) -> None:
    """Put --evaluation, --eval-metric, --eval-output and --max-drop over the spec's ``evaluation``."""
    given: dict[str, Any] = {
        k: v
        for k, v in (("data", str(evaluation) if evaluation else None), ("metric", metric), ("output", output))
        if v is not None
    }
    if max_drop is not None:
        given["max_drop"] = max_drop
    if not given:
        return
    section = data.get("evaluation")
    if section is not None and not isinstance(section, dict):
        return  # the spec's own validation names the field
    section = {**(section or {}), **given}
    if "data" not in section:
        raise InvalidSpec(
            "--eval-metric, --eval-output and --max-drop set up an evaluation, but no labelled data was given",
            hint="Add --evaluation eval.npz (inputs by input name and `labels`), or `evaluation.data` in --spec.",
            errors=[{"field": "evaluation.data", "problem": "missing"}],
        )
    data["evaluation"] = section
