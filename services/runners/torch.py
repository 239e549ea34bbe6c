"""Run TorchScript (.pt) and torch.export (.pt2) models with torch on the CPU.

Both load through :mod:`services.runners.torch_archives`, never through a bare
``torch.load``. A .pt2 carries its own signature (input names from the graph, shapes and
dtypes from its fake tensors, output names from its output structure). A TorchScript file
carries input names but no shapes: they come from the spec's ``inputs``, else from the
example inputs a traced module recorded, else INVALID_SPEC asks for them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from services.errors import InvalidSpec, SourceUnreadable
from services.runners.base import ModelRunner, TensorSpec, contiguous
from services.runners.torch_archives import load_exported_program, load_torchscript, traced_inputs

if TYPE_CHECKING:
    from services.spec import InputSpec

__all__ = [
    "ExportedProgramRunner",
    "TorchScriptRunner",
    "dynamic_axes_of",
    "leaf_names",
    "torch_dtype_name",
]

_INPUTS_HINT = (
    'Give the input shapes in the spec, e.g. {"inputs": {"x": {"shape": [1, 3, 224, 224]}}}, '
    'or min/opt/max for dynamic axes: {"inputs": {"x": {"min": [1, 3, 224, 224], "opt": [8, 3, 224, 224], '
    '"max": [32, 3, 224, 224]}}}. Traced modules (torch.jit.trace) record their example shapes.'
)


def torch_dtype_name(dtype: Any) -> str:
    """Return the numpy name of a torch dtype (``torch.float32`` → ``float32``)."""
    return str(dtype).removeprefix("torch.")


def _name_of(path: Any) -> str:
    from torch.utils import _pytree as pytree

    parts = re.findall(r"[A-Za-z0-9_]+", pytree.keystr(path))
    return "_".join(parts)


def leaf_names(tree: Any) -> list[str]:
    """Return a name per leaf of an output structure: dict keys, ``output`` or ``output_<i>``."""
    from torch.utils import _pytree as pytree

    paths = [p for p, _ in pytree.tree_flatten_with_path(tree)[0]]
    if len(paths) == 1 and not paths[0]:
        return ["output"]
    names = []
    for p in paths:
        name = _name_of(p)
        names.append(f"output_{name}" if not name or name[0].isdigit() else name)
    # Two paths can sanitise to one name ("a.b" and "a_b"); keep names unique.
    seen: dict[str, int] = {}
    unique = []
    for n in names:
        seen[n] = seen.get(n, -1) + 1
        unique.append(n if seen[n] == 0 else f"{n}_{seen[n]}")
    return unique


def dynamic_axes_of(given: InputSpec | None, rank: int) -> set[int]:
    """Return the axes of an input that stay dynamic.

    Axes the spec marks -1 in ``shape`` or that differ between ``min`` and ``max`` are
    dynamic; the batch axis (0) is dynamic unless the spec pins it (``min[0] == max[0]``).
    """
    axes: set[int] = set()
    if rank == 0:
        return axes
    pinned_batch = False
    if given is not None:
        if given.shape is not None:
            axes |= {i for i, d in enumerate(given.shape) if d == -1}
        if given.min is not None and given.max is not None:
            axes |= {i for i, (lo, hi) in enumerate(zip(given.min, given.max, strict=True)) if lo != hi}
            pinned_batch = given.min[0] == given.max[0]
    if not pinned_batch:
        axes.add(0)
    return axes


def _to_numpy(value: Any) -> np.ndarray:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


#: forward() argument types a spec ``value`` can pin, and what each accepts.
_STATIC_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "bool": (bool,)}


def _static_value(arg: Any, given: Any, what: str) -> bool | int | float:
    """Return the spec's value for a non-tensor argument, checked against its type; refuse when there is none."""
    kind = str(arg.type)
    accepted = _STATIC_TYPES.get(kind)
    value: bool | int | float | None = given.value if given is not None else None
    if accepted is None or value is None:
        pin = f' Pin it with inputs.{arg.name}.value (e.g. {{"value": 16000}}) to compile a graph specialised for it.'
        raise InvalidSpec(
            f"Kiln feeds tensors only; forward() of {what} takes {arg.name}: {kind}",
            hint=(
                "Wrap the module so forward() takes only tensors, then script or trace it again."
                if accepted is None
                else "Kiln cannot feed it per sample." + pin
            ),
            field=f"inputs.{arg.name}",
        )
    if (isinstance(value, bool) and kind != "bool") or not isinstance(value, accepted):
        raise InvalidSpec(
            f"inputs.{arg.name}.value is {value!r}; forward() of {what} takes {arg.name}: {kind}",
            hint=f"Give a {kind} value.",
            field=f"inputs.{arg.name}.value",
        )
    return float(value) if kind == "float" else value


def _fed_arguments(args: list[Any], given: dict[str, Any], what: str) -> tuple[list[str], dict[str, Any]]:
    """Return the forward() arguments Kiln feeds, positionally (the leading tensors), and the pinned ones.

    An argument with a default keeps it (with all after it) unless the spec names it; a
    required int, float or bool argument is baked in from the spec's ``inputs.<name>.value``
    (a graph specialised for it, as torch.onnx's tracing makes anyway); any other type cannot
    be fed.
    """
    names: list[str] = []
    static: dict[str, Any] = {}
    for a in args:
        if a.has_default_value() and a.name not in given:
            break
        if str(a.type) not in ("Tensor", "Optional[Tensor]"):
            static[a.name] = _static_value(a, given.get(a.name), what)
        names.append(a.name)
    rest = args[len(names) :]
    late = [a.name for a in rest if a.name in given]
    if late:
        raise InvalidSpec(f"spec inputs {late} come after an argument of {what} that keeps its default")
    required = [f"{a.name}: {a.type}" for a in rest if not a.has_default_value()]
    if required:
        raise InvalidSpec(f"Kiln feeds tensors only; forward() of {what} also requires {required}")
    unknown = sorted(set(given) - {a.name for a in args})
    if unknown:
        raise InvalidSpec(
            f"spec inputs {unknown} are not inputs of the model; forward() takes {[a.name for a in args]}",
            hint=_INPUTS_HINT,
        )
    return names, static


class TorchScriptRunner(ModelRunner):
    """A TorchScript module loaded with torch.jit.load after the archive was vetted."""

    def __init__(self, path: Path, *, inputs: dict[str, InputSpec] | None = None, **_: Any) -> None:
        import torch

        self.module = load_torchscript(path)
        try:
            schema = self.module._c._get_method("forward").schema
        except RuntimeError as exc:
            raise SourceUnreadable(f"{Path(path).name} has no forward method") from exc
        given = dict(inputs or {})
        #: forward()'s arguments in order; the pinned ones are in static_arguments
        self.arguments, self.static_arguments = _fed_arguments(
            schema.arguments[1:], given, Path(path).name
        )  # [0] is self
        traced = traced_inputs(Path(path))
        self.inputs = []
        missing = []
        for i, name in enumerate(n for n in self.arguments if n not in self.static_arguments):
            spec_in = given.get(name)
            shape = spec_in.concrete_shape() if spec_in else None
            recorded = traced[i] if traced and i < len(traced) else None
            if shape is None and recorded is not None:
                shape = list(recorded.shape)
            if shape is None:
                missing.append(name)
                continue
            dtype = (spec_in.dtype if spec_in else None) or (recorded.dtype if recorded else "float32")
            dynamic = dynamic_axes_of(spec_in, len(shape))
            self.inputs.append(
                TensorSpec(name, dtype, tuple(None if a in dynamic or d == -1 else d for a, d in enumerate(shape)))
            )
        if missing:
            raise InvalidSpec(
                f"{Path(path).name} is TorchScript without recorded input shapes; the spec must give `inputs` for {missing}",
                hint=_INPUTS_HINT,
            )
        # TorchScript types carry no output shapes or dict keys: one run on example inputs
        # of the declared shapes tells names, dtypes and ranks.
        probe = self.call_arguments({t.name: torch.from_numpy(self._example(t)) for t in self.inputs})
        with torch.no_grad():
            out = self.module(*probe)
        from torch.utils import _pytree as pytree

        leaves = pytree.tree_leaves(out)
        if not leaves or not all(isinstance(x, torch.Tensor) for x in leaves):
            raise InvalidSpec(f"forward() of {Path(path).name} must return tensors (or tuples/dicts of them)")
        batch_dynamic = bool(self.inputs) and self.inputs[0].shape[:1] == (None,)
        self.outputs = [
            TensorSpec(
                n,
                torch_dtype_name(x.dtype),
                tuple(None if (a == 0 and batch_dynamic) else int(d) for a, d in enumerate(x.shape)),
            )
            for n, x in zip(leaf_names(out), leaves, strict=True)
        ]
        #: True when forward() returns something other than a tensor or tuple of tensors
        #: (e.g. a dict from a traced Hugging Face model): ONNX export needs it flattened.
        self.structured_output = not (
            isinstance(out, torch.Tensor) or (isinstance(out, tuple) and all(isinstance(x, torch.Tensor) for x in out))
        )

    @staticmethod
    def _example(t: TensorSpec) -> np.ndarray:
        shape = [d if d is not None else (1 if i == 0 else 16) for i, d in enumerate(t.shape)]
        dtype = np.dtype(t.dtype) if t.dtype != "bfloat16" else np.dtype("float32")
        if dtype.kind in "iub":
            # Index-like inputs: ones are valid ids, mask values and segment ids alike.
            return np.ones(shape, dtype=dtype)
        return np.zeros(shape, dtype=dtype)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch
        from torch.utils import _pytree as pytree

        args = self.call_arguments({t.name: torch.from_numpy(contiguous(feeds[t.name])) for t in self.inputs})
        with torch.no_grad():
            out = self.module(*args)
        leaves = pytree.tree_leaves(out)
        return {o.name: _to_numpy(x) for o, x in zip(self.outputs, leaves, strict=True)}

    def call_arguments(self, tensors: dict[str, Any]) -> list[Any]:
        """forward()'s positional arguments: the fed tensors with the pinned values in their places."""
        return [self.static_arguments[n] if n in self.static_arguments else tensors[n] for n in self.arguments]


class ExportedProgramRunner(ModelRunner):
    """A torch.export ExportedProgram, vetted and loaded, run through ``.module()``."""

    def __init__(self, path: Path, *, inputs: dict[str, InputSpec] | None = None, **_: Any) -> None:
        import torch
        from torch.export.graph_signature import ConstantArgument, InputKind, OutputKind, TensorArgument
        from torch.utils import _pytree as pytree

        self.program = load_exported_program(path)
        sig = self.program.graph_signature
        nodes = {n.name: n for n in self.program.graph.nodes}
        #: per flat user input: its name, or ("const", value) for a constant baked into the call
        self._flat: list[tuple[str, Any]] = []
        self.inputs = []
        for spec in sig.input_specs:
            if spec.kind is not InputKind.USER_INPUT:
                continue
            if isinstance(spec.arg, TensorArgument):
                val = nodes[spec.arg.name].meta.get("val")
                shape = tuple(d if isinstance(d, int) else None for d in val.shape)
                self.inputs.append(TensorSpec(spec.arg.name, torch_dtype_name(val.dtype), shape))
                self._flat.append(("tensor", spec.arg.name))
            elif isinstance(spec.arg, ConstantArgument):
                self._flat.append(("const", spec.arg.value))
            else:
                raise InvalidSpec(
                    f"{Path(path).name} takes a symbolic scalar input {spec.arg}; Kiln feeds tensors only",
                    hint="Export with tensor inputs only.",
                )
        out_node = next(n for n in self.program.graph.nodes if n.op == "output")
        produced = {a.name: a for a in pytree.tree_leaves(out_node.args) if isinstance(a, torch.fx.Node)}
        user_outputs = [s.arg.name for s in sig.output_specs if s.kind is OutputKind.USER_OUTPUT]
        out_spec = self.program.call_spec.out_spec
        try:
            names = leaf_names(pytree.tree_unflatten(list(range(out_spec.num_leaves)), out_spec))
        except Exception:  # an exotic registered container: fall back to positions
            names = [f"output_{i}" for i in range(len(user_outputs))]
        if len(names) != len(user_outputs):
            names = [f"output_{i}" for i in range(len(user_outputs))]
        self.outputs = []
        for name, node_name in zip(names, user_outputs, strict=True):
            val = produced[node_name].meta.get("val") if node_name in produced else None
            if not isinstance(val, torch.Tensor):
                raise InvalidSpec(
                    f"{Path(path).name} returns a non-tensor output {node_name!r}; Kiln compares tensors only"
                )
            shape = tuple(d if isinstance(d, int) else None for d in val.shape)
            self.outputs.append(TensorSpec(name, torch_dtype_name(val.dtype), shape))
        unknown = sorted(set(inputs or {}) - {t.name for t in self.inputs})
        if unknown:
            raise InvalidSpec(
                f"spec inputs {unknown} are not inputs of the program; it takes {[t.name for t in self.inputs]}"
            )
        self._in_spec = self.program.call_spec.in_spec
        self.module = self.program.module()

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch
        from torch.utils import _pytree as pytree

        flat = [torch.from_numpy(contiguous(feeds[v])) if kind == "tensor" else v for kind, v in self._flat]
        args, kwargs = pytree.tree_unflatten(flat, self._in_spec)
        try:
            with torch.no_grad():
                out = self.module(*args, **kwargs)
        except AssertionError as exc:
            # torch derives these checks from the program's own dynamic ranges.
            if "Guard failed" not in str(exc):
                raise
            raise InvalidSpec(
                f"the inputs fall outside the shapes the program was exported for: {exc}",
                hint="Pick `inputs` shapes inside the program's dynamic ranges (torch.export.Dim min/max), "
                "or export it again with wider ones.",
            ) from exc
        leaves = pytree.tree_leaves(out)
        return {o.name: _to_numpy(x) for o, x in zip(self.outputs, leaves, strict=True)}
