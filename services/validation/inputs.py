"""Inputs for parity checks and calibration: the spec's .npz, else seeded random samples."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from services.errors import InvalidSpec
from services.runners.base import TensorSpec
from services.spec import MEMORY_HINT, CompileSpec, allocation_problem, input_bytes

__all__ = [
    "DEFAULT_DYNAMIC_DIM",
    "check_spec_inputs",
    "load_calibration",
    "make_validation_inputs",
    "random_input",
    "refuse_allocation",
    "resolve_shape",
]

#: Size used for a dynamic non-batch axis the spec leaves open (sequence length, image side).
DEFAULT_DYNAMIC_DIM = 16


def resolve_shape(tensor: TensorSpec, spec: CompileSpec) -> list[int]:
    """Return a concrete shape for ``tensor``: the spec's shape, else dynamic batch 1, other axes 16."""
    given = spec.inputs.get(tensor.name)
    concrete = given.concrete_shape() if given else None
    if concrete is not None:
        if len(concrete) != len(tensor.shape):
            raise InvalidSpec(
                f"inputs.{tensor.name}: shape has rank {len(concrete)}, the model's input has rank {len(tensor.shape)}",
                hint=f"The model declares {tensor.name} as {list(tensor.shape)} (None = dynamic).",
            )
        out = []
        for axis, (want, have) in enumerate(zip(concrete, tensor.shape, strict=True)):
            if have is not None and want not in (-1, have):
                raise InvalidSpec(
                    f"inputs.{tensor.name}: axis {axis} is fixed at {have} in the model, the spec asks {want}"
                )
            out.append(have if want == -1 and have is not None else (want if want != -1 else DEFAULT_DYNAMIC_DIM))
        return out
    return [d if d is not None else (1 if i == 0 else DEFAULT_DYNAMIC_DIM) for i, d in enumerate(tensor.shape)]


def check_spec_inputs(inputs: list[TensorSpec], spec: CompileSpec) -> None:
    """Refuse spec ``inputs`` that name no input of the model (INVALID_SPEC naming them), for every format."""
    names = [t.name for t in inputs]
    unknown = sorted(set(spec.inputs) - set(names))
    if unknown:
        raise InvalidSpec(
            f"spec inputs {unknown} are not inputs of the model; it takes {names}",
            hint="Key `inputs` by the model's input names (`kiln inspect MODEL` lists them).",
            errors=[{"field": f"inputs.{n}", "problem": "the model has no such input"} for n in unknown],
        )


def refuse_allocation(field_name: str, what: str, shapes: dict[str, tuple[list[int], str | None]], count: int) -> None:
    """Raise INVALID_SPEC with the estimate when ``count`` feeds of ``shapes`` would exceed the input memory limit."""
    problem = allocation_problem(field_name, what, count * input_bytes(shapes))
    if problem is not None:
        raise InvalidSpec(f"{problem['field']}: {problem['problem']}", hint=MEMORY_HINT, errors=[problem])


def load_calibration(path: str | Path, inputs: list[TensorSpec]) -> dict[str, np.ndarray]:
    """Read an .npz keyed by input name; each array stacks samples on axis 0.

    Arrays are matched to inputs by name, never by position; a missing or extra name is an
    INVALID_SPEC naming both sets. Nothing in the file is unpickled.
    """
    try:
        with np.load(Path(path), allow_pickle=False) as npz:
            data = {k: npz[k] for k in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise InvalidSpec(
            f"calibration file {path} is not a readable .npz: {exc}", hint="Write it with numpy.savez."
        ) from exc
    names = {t.name for t in inputs}
    if set(data) != names:
        raise InvalidSpec(
            f"calibration keys {sorted(data)} do not match the model inputs {sorted(names)}",
            hint="Key each array by the input name it feeds (numpy.savez(path, **{name: array})).",
        )
    counts = {k: v.shape[0] if v.ndim else 0 for k, v in data.items()}
    if len(set(counts.values())) != 1 or 0 in counts.values():
        raise InvalidSpec(f"calibration arrays need the same non-zero number of samples on axis 0, got {counts}")
    return data


def _dtype_name(t: TensorSpec) -> str:
    return t.dtype if t.dtype not in ("str", "bfloat16") else "float32"


def random_input(tensor: TensorSpec, shape: list[int], rng: np.random.Generator) -> np.ndarray:
    dtype = np.dtype(tensor.dtype) if tensor.dtype not in ("str", "bfloat16") else np.dtype("float32")
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.kind in "iu":
        # Masks want ones; ids want small non-negative values valid for tiny vocabularies.
        if "mask" in tensor.name.lower():
            return np.ones(shape, dtype=dtype)
        if "type" in tensor.name.lower() or "segment" in tensor.name.lower():
            return np.zeros(shape, dtype=dtype)
        return rng.integers(0, 16, shape).astype(dtype)
    raise InvalidSpec(f"input {tensor.name} has dtype {tensor.dtype}, which Kiln cannot generate samples for")


def make_validation_inputs(
    inputs: list[TensorSpec], spec: CompileSpec, calibration: dict[str, np.ndarray] | None = None
) -> tuple[list[dict[str, np.ndarray]], str]:
    """Return a list of feeds (one per sample batch) and where they came from.

    With calibration data the samples are its rows, batched to the model's batch size;
    otherwise ``spec.validation.samples`` seeded random feeds of the resolved shapes.
    """
    shapes = {t.name: resolve_shape(t, spec) for t in inputs}
    if calibration is not None:
        n = next(iter(calibration.values())).shape[0]
        feeds = []
        batch = max(1, min(shapes[t.name][0] if shapes[t.name] else 1 for t in inputs))
        for start in range(0, n - batch + 1, batch):
            feed = {}
            for t in inputs:
                arr = calibration[t.name][start : start + batch]
                want = shapes[t.name]
                if arr.ndim == len(want) - 1:  # samples stored without a batch axis
                    arr = arr[None, ...]
                if list(arr.shape[1:]) != want[1:] and all(d is not None for d in t.shape[1:]):
                    raise InvalidSpec(
                        f"calibration {t.name} has sample shape {list(arr.shape[1:])}, the model wants {want[1:]}"
                    )
                np_dtype = np.dtype(t.dtype) if t.dtype not in ("str", "bfloat16") else np.float32
                feed[t.name] = arr.astype(np_dtype, copy=False)
            feeds.append(feed)
        return feeds, "calibration"
    # The model's own dims count here (the spec alone could not see them): refuse before allocating.
    largest = max(inputs, key=lambda t: input_bytes({t.name: (shapes[t.name], _dtype_name(t))}), default=None)
    refuse_allocation(
        f"inputs.{largest.name}" if largest else "inputs",
        f"the validation set ({spec.validation.samples} samples of {shapes})",
        {t.name: (shapes[t.name], _dtype_name(t)) for t in inputs},
        spec.validation.samples,
    )
    rng = np.random.default_rng(spec.validation.seed)
    feeds = [{t.name: random_input(t, shapes[t.name], rng) for t in inputs} for _ in range(spec.validation.samples)]
    return feeds, f"generated (seeded random, seed={spec.validation.seed})"
