"""TensorRT optimization profiles (per input: min / opt / max shape) from an ONNX graph and the spec.

A TensorRT engine only runs shapes inside the profile it was built with, so every dynamic
axis needs a range. The rules, in order:

1. A static axis in the model is fixed: min = opt = max = its size. A spec that asks another
   size for it is INVALID_SPEC.
2. ``inputs.<name>.min/opt/max`` in the spec give the range of every axis of that input;
   ``inputs.<name>.shape`` fixes the axes it gives as a number (``-1`` leaves one open).
3. Axes sharing a symbolic name (``batch``, ``seq``) across inputs share the range: it is
   taken from whichever input the spec describes, and two different ranges for one name
   are INVALID_SPEC (TensorRT would reject the engine at run time otherwise).
4. A still-open axis 0 is the batch axis and defaults to
   ``min 1, opt max(1, max_batch_size // 2), max max_batch_size`` — the middle of the range
   is what Triton's dynamic batcher forms under moderate load, so kernels are tuned for it
   while both ends stay valid. With ``max_batch_size`` 0 (Triton batching off) the range is
   1..(largest benchmark batch size), tuned for 1. The max is never below the largest
   benchmark batch size, so Kiln's own benchmark can run.
5. Any other open axis (sequence length, image side) has no sensible default: that is
   INVALID_SPEC naming the input and axis, with the JSON to add in the hint.

One profile is derived (the spec describes one range per input); the builder accepts several.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import onnx

from services.errors import InvalidSpec
from services.spec import CompileSpec

__all__ = ["InputProfile", "ShapeProfile", "default_batch_range", "derive_profile", "model_inputs"]

Dim = int | str | None  # static size, symbolic name, or unknown


@dataclass(frozen=True)
class InputProfile:
    """The shape range TensorRT builds one input for."""

    name: str
    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]

    @property
    def is_dynamic(self) -> bool:
        return self.min != self.max

    def to_dict(self) -> dict[str, list[int]]:
        return {"min": list(self.min), "opt": list(self.opt), "max": list(self.max)}


@dataclass(frozen=True)
class ShapeProfile:
    """One optimization profile: a range per model input, in the model's input order."""

    inputs: tuple[InputProfile, ...]
    # True when every input's axis 0 is dynamic in the model, so Triton may batch requests.
    dynamic_batch: bool = False

    def __getitem__(self, name: str) -> InputProfile:
        for p in self.inputs:
            if p.name == name:
                return p
        raise KeyError(name)

    def to_dict(self) -> dict[str, dict[str, list[int]]]:
        return {p.name: p.to_dict() for p in self.inputs}


def model_inputs(model: onnx.ModelProto) -> list[tuple[str, list[Dim]]]:
    """Return the graph's real inputs (initializers excluded) with their dims."""
    inits = {i.name for i in model.graph.initializer}
    out = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        dims: list[Dim] = []
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_value") and d.dim_value > 0:
                dims.append(d.dim_value)
            elif d.HasField("dim_param") and d.dim_param:
                dims.append(d.dim_param)
            else:
                dims.append(None)
        out.append((vi.name, dims))
    return out


def default_batch_range(spec: CompileSpec) -> tuple[int, int, int]:
    """Return (min, opt, max) for an open batch axis; see the module docstring, rule 4."""
    bench_max = max(spec.benchmark_batch_sizes) if spec.bench.enabled else 1
    if spec.max_batch_size:
        return 1, max(1, spec.max_batch_size // 2), max(spec.max_batch_size, bench_max)
    return 1, 1, max(1, bench_max)


Range = tuple[int, int, int]


def _hint_json(name: str, dims: list[Dim], spec: CompileSpec, axes: set[int]) -> str:
    lo, mid, hi = default_batch_range(spec)
    mins, opts, maxs = [], [], []
    for i, d in enumerate(dims):
        if isinstance(d, int):
            mins.append(d)
            opts.append(d)
            maxs.append(d)
        elif i == 0 and i not in axes:
            mins.append(lo)
            opts.append(mid)
            maxs.append(hi)
        else:  # an example range for the caller to adjust to real data
            mins.append(1)
            opts.append(16)
            maxs.append(64)
    return json.dumps({"inputs": {name: {"min": mins, "opt": opts, "max": maxs}}})


def _spec_ranges(name: str, dims: list[Dim], spec: CompileSpec) -> list[Range | None]:
    """Return the spec's range per axis of one input (None = not given), checked against the model."""
    given = spec.inputs.get(name)
    if given is None:
        return [None] * len(dims)
    rank = len(given.opt) if given.opt is not None else (len(given.shape) if given.shape is not None else None)
    if rank is not None and rank != len(dims):
        raise InvalidSpec(
            f"inputs.{name}: the spec gives rank {rank}, the model's input has rank {len(dims)}",
            hint=f"The model declares {name} as {_show(dims)}.",
            input=name,
        )
    ranges: list[Range | None] = [None] * len(dims)
    if given.min is not None and given.opt is not None and given.max is not None:
        ranges = [(lo, mid, hi) for lo, mid, hi in zip(given.min, given.opt, given.max, strict=True)]
    if given.shape is not None:
        for axis, want in enumerate(given.shape):
            if want == -1:
                continue
            r = ranges[axis]
            if r is None:
                ranges[axis] = (want, want, want)
            elif not r[0] <= want <= r[2]:
                raise InvalidSpec(
                    f"inputs.{name}: shape asks {want} on axis {axis}, outside its range {r[0]}..{r[2]}",
                    hint="Validation and benchmarks run the shape; keep it inside min..max.",
                    input=name,
                    axis=axis,
                )
    for axis, (d, r) in enumerate(zip(dims, ranges, strict=True)):
        if isinstance(d, int) and r is not None and r != (d, d, d):
            raise InvalidSpec(
                f"inputs.{name}: axis {axis} is fixed at {d} in the model, the spec asks {r[0]}..{r[2]}",
                hint=f"The model declares {name} as {_show(dims)}; give {d} for that axis.",
                input=name,
                axis=axis,
            )
    return ranges


def _show(dims: list[Dim]) -> str:
    return "[" + ", ".join(str(d) if d is not None else "?" for d in dims) + "]"


def derive_profile(model: onnx.ModelProto, spec: CompileSpec) -> ShapeProfile:
    """Return the optimization profile for ``model`` under ``spec``; INVALID_SPEC names what is missing."""
    inputs = model_inputs(model)
    names = [n for n, _ in inputs]
    unknown = sorted(set(spec.inputs) - set(names))
    if unknown:
        raise InvalidSpec(
            f"inputs {unknown} in the spec are not inputs of the model",
            hint=f"The model's inputs are: {', '.join(names)}.",
            inputs=unknown,
        )
    per_input = {name: _spec_ranges(name, dims, spec) for name, dims in inputs}

    # Rule 3: symbolic dims share one range across inputs.
    by_symbol: dict[str, tuple[Range, str]] = {}
    for name, dims in inputs:
        for d, r in zip(dims, per_input[name], strict=True):
            if isinstance(d, str) and r is not None:
                seen = by_symbol.get(d)
                if seen is not None and seen[0] != r:
                    raise InvalidSpec(
                        f"axis {d!r} is {seen[0][0]}..{seen[0][2]} (opt {seen[0][1]}) for input {seen[1]} "
                        f"but {r[0]}..{r[2]} (opt {r[1]}) for {name}",
                        hint=f"Inputs sharing the axis name {d!r} must get the same min/opt/max.",
                        axis_name=d,
                    )
                by_symbol.setdefault(d, (r, name))

    batch = default_batch_range(spec)
    missing: list[tuple[str, int, Dim]] = []
    profiles = []
    for name, dims in inputs:
        ranges = per_input[name]
        resolved: list[Range] = []
        for axis, (d, r) in enumerate(zip(dims, ranges, strict=True)):
            if isinstance(d, int):
                resolved.append((d, d, d))
            elif r is not None:
                resolved.append(r)
            elif isinstance(d, str) and d in by_symbol:
                resolved.append(by_symbol[d][0])
            elif axis == 0:
                resolved.append(batch)
            else:
                missing.append((name, axis, d))
                resolved.append((0, 0, 0))
        profiles.append(
            InputProfile(
                name=name,
                min=tuple(r[0] for r in resolved),
                opt=tuple(r[1] for r in resolved),
                max=tuple(r[2] for r in resolved),
            )
        )
    if missing:
        first_name = missing[0][0]
        dims = dict(inputs)[first_name]
        where = ", ".join(f"{n} axis {a}" + (f" ({d!r})" if isinstance(d, str) else "") for n, a, d in missing)
        raise InvalidSpec(
            f"TensorRT needs a shape range for every dynamic axis; the spec gives none for {where}",
            hint=(
                "Add min/opt/max for the input to the spec, for example "
                + _hint_json(first_name, dims, spec, {a for n, a, _ in missing if n == first_name})
                + " (adjust the dynamic axes to your data)."
            ),
            missing=[{"input": n, "axis": a, "name": d} for n, a, d in missing],
        )
    _check_benchmark_fits(profiles, inputs, spec)
    dynamic_batch = bool(inputs) and all(dims and not isinstance(dims[0], int) for _, dims in inputs)
    return ShapeProfile(tuple(profiles), dynamic_batch=dynamic_batch)


def _check_benchmark_fits(profiles: list[InputProfile], inputs: list[tuple[str, list[Dim]]], spec: CompileSpec) -> None:
    """Refuse ranges that Kiln's own benchmark or Triton's max_batch_size would step outside."""
    dims = dict(inputs)
    wanted = max([spec.max_batch_size or 0, *(spec.benchmark_batch_sizes if spec.bench.enabled else [])])
    for p in profiles:
        d0 = dims[p.name][0] if dims[p.name] else None
        if d0 is None or isinstance(d0, int):
            continue
        if p.max[0] < wanted:
            raise InvalidSpec(
                f"inputs.{p.name}: the batch axis allows at most {p.max[0]}, but max_batch_size / "
                f"benchmark.batch_sizes need {wanted}",
                hint=f"Raise inputs.{p.name}.max[0] to {wanted}, or lower max_batch_size and benchmark.batch_sizes.",
                input=p.name,
            )
