"""Inputs for parity checks and calibration: the spec's .npz, else seeded samples that exercise the model.

Generated samples are made to reach the parts of a model a converter can break: an
attention mask pads part of every sample but the first (a masking bug shows only there),
token ids span the model's whole vocabulary (:meth:`ModelRunner.input_bounds`), token-type
ids take both segment values, floats follow the spec's ``inputs.<name>.range``; and a model
with open axes is checked at a second shape (the profile's min and max, else twice the
first size of each open axis), so a graph specialised to one shape cannot pass. Every input's
provenance is recorded (:class:`ParityInputs`) and reaches the manifest.
"""

from __future__ import annotations

import zipfile
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from services.errors import InvalidSpec
from services.runners.base import InputBound
from services.spec import MEMORY_HINT, CompileSpec, InputSpec, allocation_problem, input_bytes
from services.tensors import TensorSpec

__all__ = [
    "DEFAULT_DYNAMIC_DIM",
    "EXTRA_SHAPE_SAMPLES",
    "FEED_KEY_SEPARATOR",
    "ParityInputs",
    "add_other_shapes",
    "calibration_parity_inputs",
    "check_spec_inputs",
    "load_calibration",
    "make_parity_inputs",
    "make_validation_inputs",
    "other_shapes",
    "random_input",
    "refuse_allocation",
    "refuse_ungeneratable",
    "resolve_shape",
    "synthesize_feeds",
    "ungeneratable_inputs",
]

#: Size used for a dynamic non-batch axis the spec leaves open (sequence length, image side).
DEFAULT_DYNAMIC_DIM = 16
#: Samples checked at each shape besides the first.
EXTRA_SHAPE_SAMPLES = 2
#: Ids stay below this when the model states no vocabulary (any embedding table has more rows).
SAFE_ID_RANGE = 16


@dataclass
class ParityInputs:
    """The parity feeds, the shape each was made at, and how each input's values were made."""

    feeds: list[dict[str, np.ndarray]]
    inputs_from: str
    shape_of: list[int] = field(default_factory=list)  # per feed: index into ``shapes``
    shapes: list[dict[str, list[int]]] = field(default_factory=list)  # 0: the first (spec's) shape
    provenance: dict[str, str] = field(default_factory=dict)
    #: what a verdict on these feeds rests on: samples no quantiser saw (real, synthesized, generated), required
    evidence: dict[str, int] = field(default_factory=dict)

    def drop_shape(self, index: int) -> None:
        """Remove the feeds made at shape ``index`` (the source cannot run them)."""
        keep = [i for i, g in enumerate(self.shape_of) if g != index]
        self.feeds = [self.feeds[i] for i in keep]
        self.shape_of = [self.shape_of[i] for i in keep]


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
            if want == -1:  # open in the spec: the model's own size, else what an unspecified axis gets
                out.append(have if have is not None else (1 if axis == 0 else DEFAULT_DYNAMIC_DIM))
            else:
                out.append(want)
        return out
    return [d if d is not None else (1 if i == 0 else DEFAULT_DYNAMIC_DIM) for i, d in enumerate(tensor.shape)]


def check_spec_inputs(inputs: list[TensorSpec], spec: CompileSpec, static: Collection[str] = ()) -> None:
    """Refuse spec ``inputs`` that name no input of the model (INVALID_SPEC naming them), for every format.

    ``static``: arguments the model takes that the spec pinned to a value (baked in, not fed).
    """
    names = [t.name for t in inputs]
    unknown = sorted(set(spec.inputs) - set(names) - set(static))
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


#: A calibration file whose every key is ``<sample>/<input>`` holds whole feeds, one per sample.
FEED_KEY_SEPARATOR = "/"


def load_calibration(path: str | Path, inputs: list[TensorSpec]) -> dict[str, np.ndarray] | list[dict[str, np.ndarray]]:
    """Read an .npz of real inputs, in one of two layouts; nothing in the file is unpickled.

    - keyed by input name, each array stacking samples on axis 0 (the default layout);
    - keyed ``<sample>/<input>``, each sample a complete feed of any shapes (scalars, a state
      whose batch axis is not 0, inputs of different counts): returned as a list of feeds in
      sample order.

    Arrays are matched to inputs by name, never by position; a missing or extra name is an
    INVALID_SPEC naming both sets.
    """
    try:
        with np.load(Path(path), allow_pickle=False) as npz:
            data = {k: npz[k] for k in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise InvalidSpec(
            f"calibration file {path} is not a readable .npz: {exc}", hint="Write it with numpy.savez."
        ) from exc
    names = {t.name for t in inputs}
    if data and all(FEED_KEY_SEPARATOR in k for k in data) and not names & set(data):
        return _whole_feeds(data, names)
    if set(data) != names:
        raise InvalidSpec(
            f"calibration keys {sorted(data)} do not match the model inputs {sorted(names)}",
            hint="Key each array by the input name it feeds (numpy.savez(path, **{name: array})), or key whole "
            "feeds as '<sample>/<input>'.",
        )
    counts = {k: v.shape[0] if v.ndim else 0 for k, v in data.items()}
    if len(set(counts.values())) != 1 or 0 in counts.values():
        raise InvalidSpec(
            f"calibration arrays need the same non-zero number of samples on axis 0, got {counts}",
            hint="Inputs whose samples do not stack on axis 0 (scalars, a state batched on another axis) go in "
            "the whole-feed layout: keys '<sample>/<input>', one complete feed per sample.",
        )
    return data


def _whole_feeds(data: dict[str, np.ndarray], names: set[str]) -> list[dict[str, np.ndarray]]:
    samples: dict[str, dict[str, np.ndarray]] = {}
    for key, arr in data.items():
        sample, _, name = key.partition(FEED_KEY_SEPARATOR)
        samples.setdefault(sample, {})[name] = arr
    for sample, feed in samples.items():
        if set(feed) != names:
            raise InvalidSpec(
                f"calibration sample {sample!r} holds inputs {sorted(feed)}, the model takes {sorted(names)}",
                hint="Each sample of the '<sample>/<input>' layout is a complete feed: one array per model input.",
            )
    order = sorted(samples, key=lambda k: (not k.isdigit(), int(k) if k.isdigit() else 0, k))
    return [samples[k] for k in order]


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


def other_shapes(inputs: list[TensorSpec], spec: CompileSpec) -> list[dict[str, list[int]]]:
    """Return the shapes to check besides the first: the profile's min and max, else open axes doubled.

    An axis counts as open when the model leaves it dynamic and the spec does not pin it.
    Empty when nothing is open (a fixed-shape model, or every axis pinned).
    """
    first = {t.name: resolve_shape(t, spec) for t in inputs}
    profiles = {t.name: spec.inputs[t.name] for t in inputs if t.name in spec.inputs and spec.inputs[t.name].min}
    if profiles:
        out = []
        for which in ("min", "max"):
            shape = {name: list(getattr(profiles[name], which)) if name in profiles else first[name] for name in first}
            if shape != first and shape not in out:
                out.append(shape)
        return out
    second: dict[str, list[int]] = {}
    for t in inputs:
        given = spec.inputs.get(t.name)
        pinned = given.concrete_shape() if given else None
        dims = []
        for axis, (have, now) in enumerate(zip(t.shape, first[t.name], strict=True)):
            open_axis = have is None and (pinned is None or pinned[axis] == -1)
            dims.append(now * 2 if open_axis else now)
        second[t.name] = dims
    return [second] if second != first else []


def _ids(shape: list[int], rng: np.random.Generator, low: int, high: int) -> np.ndarray:
    return rng.integers(low, max(high, low + 1), shape)


def _two_parts(shape: list[int], index: int, rng: np.random.Generator, head: int, tail: int) -> np.ndarray:
    """Return ``head`` values, the tail of the last axis from a random cut set to ``tail`` (not on sample 0).

    An attention mask is ones then padding (1, 0); token-type ids are the first segment then
    the second (0, 1). The first sample keeps one part only (full length, one segment).
    """
    out = np.full(shape, head, dtype=np.int64)
    if index == 0 or not shape or shape[-1] < 2:
        return out
    flat = out.reshape(-1, shape[-1])
    for row in flat:
        row[int(rng.integers(1, shape[-1])) :] = tail  # keep at least one position of the head
    return flat.reshape(shape)


def sample_input(
    tensor: TensorSpec,
    shape: list[int],
    rng: np.random.Generator,
    *,
    index: int,
    given: InputSpec | None = None,
    bound: InputBound | None = None,
    observed: tuple[float, float] | None = None,
) -> tuple[np.ndarray, str]:
    """Return one generated parity sample of ``tensor`` and how its values were made."""
    dtype = np.dtype(_dtype_name(tensor))
    name = tensor.name.lower()
    if given is not None and given.value is not None:
        return np.full(shape, given.value, dtype=dtype), f"the spec's value {given.value}"
    span = given.range if given is not None and given.range is not None else None
    if dtype.kind == "f":
        if span is not None:
            return rng.uniform(span[0], span[1], shape).astype(dtype), f"uniform in the spec's range {span}"
        if observed is not None:
            lo, hi = observed
            return rng.uniform(lo, hi, shape).astype(
                dtype
            ), f"uniform in the calibration data's range [{lo:.4g}, {hi:.4g}]"
        return rng.standard_normal(shape).astype(dtype), "standard normal (give inputs.<name>.range for another)"
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(bool), "random booleans"
    if dtype.kind not in "iu":
        raise InvalidSpec(f"input {tensor.name} has dtype {tensor.dtype}, which Kiln cannot generate samples for")
    if span is not None:
        lo, hi = int(np.ceil(span[0])), int(np.floor(span[1]))
        return _ids(shape, rng, lo, hi).astype(dtype), f"integers in the spec's range [{lo}, {hi})"
    if "mask" in name:
        mask = _two_parts(shape, index, rng, 1, 0).astype(dtype)
        return mask, "ones, the tail padded with zeros on all but the first sample"
    if "type" in name or "segment" in name:
        if bound is not None and bound.high >= 2:
            return _two_parts(shape, index, rng, 0, 1).astype(dtype), f"two segments, 0 then 1 ({bound.why})"
        return np.zeros(shape, dtype=dtype), "zeros: the model states no second segment value"
    if observed is not None:
        lo, hi = int(observed[0]), int(observed[1]) + 1
        return _ids(shape, rng, lo, hi).astype(dtype), f"integers in the calibration data's range [{lo}, {hi})"
    if bound is not None:
        return _ids(shape, rng, 0, bound.high).astype(dtype), f"ids in [0, {bound.high}): {bound.why}"
    return (
        _ids(shape, rng, 0, SAFE_ID_RANGE).astype(dtype),
        f"integers in [0, {SAFE_ID_RANGE}): the model states no range (give inputs.<name>.range)",
    )


def ungeneratable_inputs(inputs: list[TensorSpec], spec: CompileSpec, bounds: dict[str, InputBound]) -> dict[str, str]:
    """Return the inputs no generated value is valid for (shape operands, sequences), with why; a range counts."""
    out = {}
    for t in inputs:
        bound = bounds.get(t.name)
        given = spec.inputs.get(t.name)
        said = given is not None and (given.range is not None or given.value is not None)
        if bound is not None and not bound.generatable and not said:
            out[t.name] = bound.why
    return out


def refuse_ungeneratable(inputs: list[TensorSpec], spec: CompileSpec, bounds: dict[str, InputBound]) -> None:
    """Refuse (INVALID_SPEC, asking for sample data) a model whose inputs Kiln cannot make up, without data."""
    missing = ungeneratable_inputs(inputs, spec, bounds)
    if not missing:
        return
    said = "; ".join(f"{name}: {why}" for name, why in missing.items())
    raise InvalidSpec(
        f"inputs {sorted(missing)} need real sample data: no generated value is valid for them ({said})",
        hint="Give `calibration`, an .npz of real inputs keyed by input name (samples on axis 0), or "
        "`inputs.<name>.range` for an integer input whose valid values you know.",
        errors=[{"field": f"inputs.{n}", "problem": f"needs sample data: {why}"} for n, why in missing.items()],
    )


def make_parity_inputs(
    inputs: list[TensorSpec],
    spec: CompileSpec,
    bounds: dict[str, InputBound] | None = None,
    *,
    seed: int | None = None,
    samples: int | None = None,
    extra_shapes: bool = True,
) -> ParityInputs:
    """Return generated parity feeds at the first shape, and a few at each other shape the model's open axes
    allow (see :func:`other_shapes`)."""
    bounds = bounds or {}
    refuse_ungeneratable(inputs, spec, bounds)
    first = {t.name: resolve_shape(t, spec) for t in inputs}
    seed = spec.validation.seed if seed is None else seed
    rng = np.random.default_rng(seed)
    count = spec.validation.samples if samples is None else samples
    _refuse_too_large(inputs, spec, first, count)
    feeds: list[dict[str, np.ndarray]] = []
    provenance: dict[str, str] = {}
    for i in range(count):
        feed = {}
        for t in inputs:
            feed[t.name], provenance[t.name] = sample_input(
                t, first[t.name], rng, index=i, given=spec.inputs.get(t.name), bound=bounds.get(t.name)
            )
        feeds.append(feed)
    out = ParityInputs(feeds, f"generated (seeded, seed={seed})", [0] * len(feeds), [first], provenance)
    if extra_shapes:
        add_other_shapes(out, inputs, spec, bounds, rng)
    return out


def calibration_parity_inputs(
    feeds: list[dict[str, np.ndarray]], inputs: list[TensorSpec], spec: CompileSpec
) -> ParityInputs:
    """Return parity inputs made of calibration rows (already batched to the first shape)."""
    first = {t.name: resolve_shape(t, spec) for t in inputs}
    provenance = {t.name: "rows of the calibration file" for t in inputs}
    return ParityInputs(list(feeds), "calibration", [0] * len(feeds), [first], provenance)


def add_other_shapes(
    parity: ParityInputs,
    inputs: list[TensorSpec],
    spec: CompileSpec,
    bounds: dict[str, InputBound] | None = None,
    rng: np.random.Generator | None = None,
) -> None:
    """Append :data:`EXTRA_SHAPE_SAMPLES` feeds at each shape of :func:`other_shapes` to ``parity``.

    Where a shape differs from the first only on the batch axis, its feeds stack the first
    shape's samples (real rows when they came from a calibration file); otherwise they are
    generated, within the value range the first samples span when those are real data.
    """
    bounds = bounds or {}
    rng = rng or np.random.default_rng(spec.validation.seed + 2)
    base = [f for f, g in zip(parity.feeds, parity.shape_of, strict=True) if g == 0]
    real = parity.inputs_from == "calibration"
    observed: dict[str, tuple[float, float]] = {}
    if real and base:
        for t in inputs:
            values = np.concatenate([np.asarray(f[t.name]).reshape(-1) for f in base])
            if values.size and values.dtype.kind in "fiu":
                observed[t.name] = (float(values.min()), float(values.max()))
    first = parity.shapes[0]
    unmade = ungeneratable_inputs(inputs, spec, bounds)
    for shape in other_shapes(inputs, spec):
        batch_only = base and all(shape[n][1:] == first[n][1:] and len(shape[n]) > 0 for n in shape)
        if not batch_only and unmade:
            parity.provenance[f"shape {shape}"] = f"not checked: {sorted(unmade)} would need real data at that shape"
            continue
        _refuse_too_large(inputs, spec, shape, EXTRA_SHAPE_SAMPLES)
        parity.shapes.append(shape)
        group = len(parity.shapes) - 1
        for i in range(EXTRA_SHAPE_SAMPLES):
            if batch_only:
                feed = {}
                for t in inputs:
                    rows = np.concatenate([np.asarray(f[t.name]) for f in base], axis=0)
                    want = shape[t.name][0]
                    take = [(i * want + k) % rows.shape[0] for k in range(want)]
                    feed[t.name] = rows[take]
            else:
                feed = {}
                for t in inputs:
                    feed[t.name], _ = sample_input(
                        t,
                        shape[t.name],
                        rng,
                        index=i + 1,  # padded: the first shape already has a full-length sample
                        given=spec.inputs.get(t.name),
                        bound=bounds.get(t.name),
                        observed=observed.get(t.name),
                    )
            parity.feeds.append(feed)
            parity.shape_of.append(group)
        how = "the first shape's samples stacked" if batch_only else "generated"
        parity.provenance[f"shape {group}"] = f"{shape}: {EXTRA_SHAPE_SAMPLES} samples, {how}"


def _refuse_too_large(inputs: list[TensorSpec], spec: CompileSpec, shapes: dict[str, list[int]], count: int) -> None:
    # The model's own dims count here (the spec alone could not see them): refuse before allocating.
    largest = max(inputs, key=lambda t: input_bytes({t.name: (shapes[t.name], _dtype_name(t))}), default=None)
    refuse_allocation(
        f"inputs.{largest.name}" if largest else "inputs",
        f"the validation set ({count} samples of {shapes})",
        {t.name: (shapes[t.name], _dtype_name(t)) for t in inputs},
        count,
    )


#: A synthesized sample is this much of one real row (the rest from a second): near the data, not on it.
MIX_WEIGHT = (0.6, 0.9)
#: Noise added to a synthesized float input, as a share of that input's spread over the rows.
PERTURBATION = 0.05
#: Share of an integer input's values (ids, bytes) redrawn from the values the rows hold.
REDRAWN = 0.1
#: Integer inputs kept as the base row has them: their values carry structure a redraw would break.
_KEPT_INTEGERS = ("mask", "type", "segment")


def synthesize_feeds(
    rows: list[dict[str, np.ndarray]], count: int, rng: np.random.Generator
) -> tuple[list[dict[str, np.ndarray]], str]:
    """Return ``count`` check inputs made from real ``rows``, and how they were made.

    Each is one row (the base) mixed with another: floats ``w * base + (1 - w) * other`` with
    ``w`` in :data:`MIX_WEIGHT`, plus Gaussian noise of :data:`PERTURBATION` of the input's
    spread, clipped to the range the rows span; integer ids and bytes take a span of the other
    row's values and :data:`REDRAWN` of their values redrawn from those the rows hold; masks,
    segment ids and inputs whose rows hold one value stay as the base row has them. An input
    whose two rows differ in shape is perturbed only. Measured on real int8 artifacts
    (docs/benchmarks.md, "Evidence"): equal mixtures of two document images scored Pearson
    0.87 where no real page went under 0.96, so the base row stays dominant.
    """
    if not rows or count <= 0:
        return [], ""
    spread: dict[str, tuple[float, float, float]] = {}
    seen: dict[str, np.ndarray] = {}
    for name in rows[0]:
        values = np.concatenate([np.asarray(r[name]).reshape(-1) for r in rows if name in r])
        if values.size and values.dtype.kind == "f":
            finite = values[np.isfinite(values)]
            if finite.size:
                spread[name] = (float(finite.min()), float(finite.max()), float(finite.std()))
        elif values.size and values.dtype.kind in "iu":
            seen[name] = np.unique(values)
    out = []
    for _ in range(count):
        i = int(rng.integers(len(rows)))
        j = (i + 1 + int(rng.integers(len(rows) - 1))) % len(rows) if len(rows) > 1 else i
        base, other = rows[i], rows[j]
        feed = {}
        for name, x in base.items():
            x = np.asarray(x)
            y = np.asarray(other.get(name, x))
            if name in spread:
                lo, hi, sd = spread[name]
                z = x.astype(np.float64)
                if y.shape == x.shape:
                    w = rng.uniform(*MIX_WEIGHT)
                    z = w * z + (1.0 - w) * y
                z = z + rng.standard_normal(z.shape) * (PERTURBATION * sd)
                feed[name] = np.clip(z, lo, hi).astype(x.dtype)
            elif name in seen and seen[name].size > 1 and not any(k in name.lower() for k in _KEPT_INTEGERS):
                z = x.copy()
                if y.shape == x.shape and z.ndim:
                    length = z.shape[-1]
                    start = int(rng.integers(length))
                    stop = int(rng.integers(start, length + 1))
                    z[..., start:stop] = y[..., start:stop]
                redraw = rng.random(z.shape) < REDRAWN
                z[redraw] = rng.choice(seen[name], size=int(redraw.sum())).astype(z.dtype)
                feed[name] = z
            else:
                feed[name] = x
        out.append(feed)
    how = (
        f"{count} made from the file's {len(rows)} rows (held out and calibration): each one row mixed with another "
        f"(weight {MIX_WEIGHT[0]}-{MIX_WEIGHT[1]} on the first) plus noise of {PERTURBATION:.0%} of each float input's "
        f"spread, clipped to its measured range; integer ids spliced from the two rows with {REDRAWN:.0%} redrawn "
        "from the values the rows hold (masks and segment ids kept)"
    )
    return out, how
