"""Open TorchScript (.pt) and torch.export (.pt2) archives without running code from them.

TorchScript's loader is safe by construction: its C++ unpickler resolves only TorchScript
types and its code runs in the TorchScript interpreter, not Python. We still scan the
archive's pickles first, so a smuggled Python global is refused as UNSAFE_INPUT by name
instead of surfacing as a loader error.

``torch.export.load`` is NOT safe on untrusted files (torch 2.13, measured in
tests/test_torch_sources.py): it falls back to ``torch.load(weights_only=False)`` when the
sample inputs do not unpickle safely, calls ``pickle.loads`` on "opaque" constants,
``torch.load(weights_only=False)`` on pickled weights, ``sympy.sympify`` (an ``eval``) on
every symbolic-shape expression, ``importlib.import_module`` on enum names in pytree
contexts, loads AOTInductor shared libraries, and ``exec``s the archive's ``guards_code``
when the module first runs. So a .pt2 is vetted here member by member, its model JSON is
checked (expressions parsed against an allowlist) and rewritten (guards dropped, output
structures of unregistered classes turned into plain dicts), the archive is re-packed in
memory, and only then handed to ``torch.export.load`` with weights-only loading forced.
After loading, every graph node must call an ATen/prims operator or a plain builtin.
"""

from __future__ import annotations

import ast
import io
import json
import os
import pickle
import pickletools
import re
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.errors import SourceUnreadable, UnsafeInput
from services.formats.archives import ArchiveLimits

if TYPE_CHECKING:
    import torch

__all__ = [
    "TracedInput",
    "check_pt2_archive",
    "check_torchscript_archive",
    "load_exported_program",
    "load_torchscript",
    "traced_inputs",
]

_PT2_HINT = (
    "Re-export with a current torch: torch.export.save(torch.export.export(model, args)) with plain "
    "tensors as weights and example inputs, or save TorchScript (torch.jit.trace(model, args).save(path))."
)
_TS_HINT = "Save the model with torch.jit.trace(model, example).save(path) or torch.jit.script(model).save(path)."


# ----------------------------------------------------------------------------- zip members


_LIMITS = ArchiveLimits()


def _read_members(data: bytes, what: str, limits: ArchiveLimits = _LIMITS) -> tuple[str, dict[str, bytes]]:
    """Return the archive's root folder and its members (relative to it), refusing ambiguity.

    torch reads these archives with its own zip reader; two readers can disagree on
    duplicate names or members outside the root folder, so both are refused.
    """
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile as exc:
        raise SourceUnreadable(f"{what} is not a readable zip archive: {exc}") from exc
    infos = zf.infolist()
    names = [i.filename for i in infos]
    if len(names) != len(set(names)):
        dupes = sorted({n for n in names if names.count(n) > 1})[:5]
        raise UnsafeInput(f"{what} has duplicate archive members {dupes}", hint=_PT2_HINT)
    if len(infos) > limits.max_members or sum(i.file_size for i in infos) > limits.max_total_bytes:
        raise UnsafeInput(f"{what} expands beyond {limits.max_total_bytes} bytes or {limits.max_members} members")
    roots = {n.split("/", 1)[0] for n in names}
    if len(roots) != 1 or any("/" not in n for n in names):
        raise UnsafeInput(f"{what} has members outside a single root folder: {sorted(roots)[:5]}", hint=_PT2_HINT)
    root = roots.pop()
    try:
        members = {n.split("/", 1)[1]: zf.read(n) for n in names if not n.endswith("/")}
    except (zipfile.BadZipFile, OSError, RuntimeError) as exc:  # CRC errors, encrypted members
        raise SourceUnreadable(f"{what} has an unreadable member: {exc}") from exc
    return root, members


def _repack(root: str, members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        for name, body in members.items():
            zf.writestr(f"{root}/{name}", body)
    return buf.getvalue()


# ----------------------------------------------------------------------------- TorchScript


def _pickle_globals(body: bytes) -> Iterator[tuple[str, str]]:
    """Yield the (module, name) of every global a pickle would import, without unpickling it."""
    for op, arg, _ in pickletools.genops(io.BytesIO(body)):
        if op.name in ("GLOBAL", "INST"):
            module, _, name = str(arg).partition(" ")
            yield module, name
        elif op.name == "STACK_GLOBAL":
            # TorchScript writes protocol-2 GLOBAL opcodes only. STACK_GLOBAL takes its names
            # from the stack, where memo tricks can hide them from a static scan: refuse it.
            yield "<STACK_GLOBAL>", "?"


def _torchscript_global(module: str, name: str) -> bool:
    """Return True for a global a TorchScript archive's pickles may name.

    TorchScript classes (``__torch__.*``, defined by the archive's code/), torch's tensor
    rebuild helpers, storages, dtypes and qschemes, and OrderedDict. Anything else (io.open,
    os.system, builtins.eval) is a smuggled Python object: TorchScript's C++ unpickler would
    refuse it too, but the user is told why.
    """
    import torch

    if module == "__torch__" or module.startswith("__torch__."):
        return True
    if (module, name) == ("collections", "OrderedDict") or module == "torch.jit._pickle":
        return True
    if module == "torch._utils":
        return name.startswith("_rebuild_")
    if module == "torch":
        kinds = (torch.dtype, torch.qscheme, torch.layout, torch.memory_format)
        return name.endswith("Storage") or name in ("device", "Size") or isinstance(getattr(torch, name, None), kinds)
    return False


def check_torchscript_archive(data: bytes, what: str = "TorchScript archive") -> dict[str, bytes]:
    """Vet a TorchScript zip; return its members. UNSAFE_INPUT names any foreign pickle global."""
    _, members = _read_members(data, what)
    if "data.pkl" not in members or not any(n.startswith("code/") for n in members):
        raise SourceUnreadable(f"{what} has no data.pkl and code/: not a TorchScript archive", hint=_TS_HINT)
    for name, body in members.items():
        if not name.endswith((".pkl", ".debug_pkl")):
            continue
        try:
            for module, attr in _pickle_globals(body):
                if not _torchscript_global(module, attr):
                    raise UnsafeInput(
                        f"{what}: {name} imports {module}.{attr}, which is not a TorchScript type; "
                        "Kiln never unpickles arbitrary Python objects",
                        hint=_TS_HINT,
                    )
        except (ValueError, IndexError) as exc:  # pickletools on a malformed stream
            raise SourceUnreadable(f"{what}: {name} is not a readable pickle: {exc}") from exc
    return members


def load_torchscript(path: Path) -> torch.jit.ScriptModule:
    """Return the vetted TorchScript module at ``path``, on the CPU, in eval mode."""
    import torch

    data = Path(path).read_bytes()
    check_torchscript_archive(data, Path(path).name)
    try:
        module = torch.jit.load(io.BytesIO(data), map_location="cpu")
    except Exception as exc:  # TorchScript raises RuntimeError subclasses for bad archives
        raise SourceUnreadable(f"torch.jit.load cannot read {Path(path).name}: {exc}", hint=_TS_HINT) from exc
    return module.eval()


@dataclass(frozen=True)
class TracedInput:
    """Dtype (numpy name) and shape of one example input a traced module recorded."""

    dtype: str
    shape: tuple[int, ...]


_STORAGE_DTYPES = {
    "FloatStorage": "float32",
    "DoubleStorage": "float64",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
}


class _StorageType:
    def __init__(self, dtype: str) -> None:
        self.dtype = dtype


def _rebuild_tensor_meta(storage: Any, _offset: Any, size: Any, *_: Any) -> TracedInput:
    if not isinstance(storage, _StorageType):
        raise pickle.UnpicklingError("tensor without a storage type")
    return TracedInput(storage.dtype, tuple(int(d) for d in size))


class _TracedInputsUnpickler(pickle.Unpickler):
    """Reads traced_inputs.pkl into shapes and dtypes; every global maps to a local stand-in."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor_meta
        if (module, name) == ("torch.jit._pickle", "restore_type_tag"):
            return lambda value, _tag: value
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        raise pickle.UnpicklingError(f"traced_inputs.pkl names {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        # ("storage", storage_type, key, location, numel): only the type matters for metadata.
        if isinstance(pid, tuple) and len(pid) >= 2 and isinstance(pid[1], _StorageType):
            return pid[1]
        raise pickle.UnpicklingError("unexpected persistent id in traced_inputs.pkl")


def traced_inputs(data: bytes | Path, method: str = "forward") -> list[TracedInput] | None:
    """Return the example inputs a traced TorchScript module recorded for ``method``, if any.

    torch.jit.load drops them (its _retrieve_traced_inputs() comes back empty), so the
    archive's traced_inputs.pkl is read here, with stand-ins for every global: no torch
    object is built and nothing from the file runs.
    """
    raw = Path(data).read_bytes() if isinstance(data, Path) else data
    _, members = _read_members(raw, "TorchScript archive")
    body = members.get("traced_inputs.pkl")
    if not body:
        return None
    try:
        table = _TracedInputsUnpickler(io.BytesIO(body)).load()
    except (pickle.UnpicklingError, EOFError, TypeError, ValueError, IndexError) as exc:
        raise UnsafeInput(f"traced_inputs.pkl is not a plain record of example tensors: {exc}", hint=_TS_HINT) from exc
    found = table.get(method) if isinstance(table, dict) else None
    if not found or not all(isinstance(t, TracedInput) for t in found):
        return None
    return list(found)


# ----------------------------------------------------------------------------- torch.export


# sympy names the torch serializer writes (srepr of shape expressions) plus torch's own
# sympy functions. Expressions are parsed as Python and must use only these calls, names,
# literals and arithmetic: no attributes, subscripts, lambdas or dunders reach sympify's eval.
_SYMPY_CALLS = frozenset(
    {
        "Symbol", "Integer", "Rational", "Float", "Add", "Mul", "Pow", "Mod", "Max", "Min", "Abs",
        "floor", "ceiling", "sqrt", "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "StrictLessThan", "LessThan",
        "StrictGreaterThan", "GreaterThan", "Equality", "Unequality", "And", "Or", "Not", "Piecewise",
        "ExprCondPair", "Tuple", "FloorDiv", "ModularIndexing", "Where", "PythonMod", "CleanDiv",
        "CeilToInt", "FloorToInt", "CeilDiv", "LShift", "RShift", "PowByNatural", "FloatPow",
        "FloatTrueDiv", "IntTrueDiv", "IsNonOverlappingAndDenseIndicator", "TruncToFloat", "TruncToInt",
        "RoundToInt", "RoundDecimal", "ToFloat", "Identity",
    }
)  # fmt: skip
_SYMPY_NAMES = frozenset({"oo", "zoo", "nan", "true", "false", "pi", "E", "S"})
_SYMPY_KEYWORDS = frozenset(
    {"positive", "negative", "nonnegative", "nonpositive", "integer", "real", "finite", "zero",
     "nonzero", "even", "odd", "commutative", "precision", "evaluate", "extended_real", "rational"}
)  # fmt: skip
# String literals are symbol names (Symbol('s77')) or numbers (Float('1.5', precision=53)).
_PLAIN_STRING = re.compile(r"^([A-Za-z_][A-Za-z0-9_]{0,63}|[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?)$")
_AST_OPS = (
    ast.Expression, ast.Load, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.Tuple,
    ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.USub, ast.UAdd, ast.Not,
    ast.And, ast.Or, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE,
)  # fmt: skip
MAX_EXPR_CHARS = 4096


def _check_sympy_expr(expr: Any) -> None:
    """Refuse a shape expression sympify could turn into code execution."""
    if not isinstance(expr, str) or len(expr) > MAX_EXPR_CHARS or "__" in expr:
        raise UnsafeInput(
            f"symbolic shape expression {str(expr)[:80]!r} is not a plain sympy expression", hint=_PT2_HINT
        )
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as exc:
        raise UnsafeInput(f"symbolic shape expression {expr[:80]!r} does not parse: {exc.msg}", hint=_PT2_HINT) from exc
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            ok = isinstance(node.func, ast.Name) and node.func.id in _SYMPY_CALLS
            ok = ok and all(k.arg in _SYMPY_KEYWORDS for k in node.keywords)
        elif isinstance(node, ast.Name):
            ok = node.id in _SYMPY_CALLS or node.id in _SYMPY_NAMES
        elif isinstance(node, ast.Constant):
            ok = isinstance(node.value, (int, float, bool)) or (
                isinstance(node.value, str) and bool(_PLAIN_STRING.match(node.value))
            )
        elif isinstance(node, ast.keyword):
            ok = node.arg in _SYMPY_KEYWORDS
        else:
            ok = isinstance(node, _AST_OPS)
        if not ok:
            raise UnsafeInput(
                f"symbolic shape expression {expr[:80]!r} contains {type(node).__name__}, "
                "which a torch.export archive never needs; sympy would evaluate it as Python",
                hint=_PT2_HINT,
            )


# pytree node types whose contexts torch decodes without importing anything.
_BUILTIN_TREE_TYPES = frozenset(
    {
        "builtins.tuple", "builtins.list", "builtins.dict", "collections.OrderedDict",
        "collections.defaultdict", "collections.deque", "collections.namedtuple",
        "torch.fx.immutable_collections.immutable_list", "torch.fx.immutable_collections.immutable_dict",
    }
)  # fmt: skip


def _no_enum(value: Any) -> None:
    # torch decodes pytree contexts with an object hook that imports the module an
    # "__enum__" entry names; a model never needs that, so any such entry is refused.
    if isinstance(value, dict):
        if "__enum__" in value:
            raise UnsafeInput(
                "a pytree context in the archive asks torch to import a module (__enum__)", hint=_PT2_HINT
            )
        for v in value.values():
            _no_enum(v)
    elif isinstance(value, list):
        for v in value:
            _no_enum(v)


def _rewrite_tree(node: dict[str, Any]) -> dict[str, Any]:
    """Return a treespec node with contexts vetted and dataclass-like types made plain dicts."""
    typ, ctx, children = node.get("type"), node.get("context"), node.get("children_spec") or []
    if typ is None:
        if ctx is not None or children:
            raise SourceUnreadable("malformed pytree leaf in the archive")
        return node
    try:
        decoded = json.loads(ctx) if isinstance(ctx, str) else ctx
    except json.JSONDecodeError as exc:
        raise SourceUnreadable(f"pytree context of {typ} is not JSON: {exc}") from exc
    _no_enum(decoded)
    kids = [_rewrite_tree(c) for c in children]
    if typ not in _BUILTIN_TREE_TYPES:
        # e.g. transformers' ModelOutput: keyed like a dict, but deserialising it needs the
        # class registered in this process (importing the library that defines it). Kiln only
        # needs the leaves and their keys, so the node becomes the dict it behaves as.
        if isinstance(decoded, list) and len(decoded) == len(kids) and all(isinstance(k, str) for k in decoded):
            return {"type": "builtins.dict", "context": json.dumps(decoded), "children_spec": kids}
        raise SourceUnreadable(
            f"the archive's inputs or outputs use {typ}, a structure Kiln cannot read without importing it",
            hint="Export with plain tensors, tuples or dicts as inputs and outputs (e.g. return_dict=False).",
        )
    return {**node, "children_spec": kids}


def _rewrite_treespec(text: Any) -> Any:
    if not isinstance(text, str) or not text:
        return text
    try:
        protocol, schema = json.loads(text)
    except (json.JSONDecodeError, TypeError, ValueError) as exc:
        raise SourceUnreadable(f"unreadable pytree spec in the archive: {exc}") from exc
    return json.dumps([protocol, _rewrite_tree(schema)])


# Graph inputs torch may turn into guard code. A string input's value is pasted into it
# between quotes, unescaped (torch/export/_unlift.py: f"{src} == '{meta}'"), so it must not
# be able to close them; custom-object inputs would need a pickle.
_GRAPH_INPUT_KINDS = frozenset({"as_tensor", "as_sym_int", "as_int", "as_float", "as_bool", "as_none", "as_string"})
_QUOTABLE = re.compile(r"^[^'\"\\\x00-\x1f\x7f]*$")


def _vet_graph_inputs(graph: dict[str, Any]) -> None:
    for arg in graph.get("inputs") or []:
        kinds = set(arg) if isinstance(arg, dict) else {repr(arg)}
        if not kinds <= _GRAPH_INPUT_KINDS:
            raise UnsafeInput(f"the exported graph takes a {sorted(kinds - _GRAPH_INPUT_KINDS)} input", hint=_PT2_HINT)
        text = arg.get("as_string") if isinstance(arg, dict) else None
        if text is not None and not (isinstance(text, str) and _QUOTABLE.match(text)):
            raise UnsafeInput(
                f"the exported graph takes a string input {str(text)[:60]!r} with quotes or control "
                "characters; torch would paste it into generated Python code",
                hint=_PT2_HINT,
            )


def _vet_model_json(obj: Any) -> Any:
    """Walk the serialized ExportedProgram: check expressions, rewrite treespecs; return it."""
    if isinstance(obj, dict):
        if isinstance(obj.get("inputs"), list) and isinstance(obj.get("nodes"), list):
            _vet_graph_inputs(obj)
        out = {}
        for key, value in obj.items():
            if key == "expr_str":
                _check_sympy_expr(value)
                out[key] = value
            elif key in ("in_spec", "out_spec"):
                out[key] = _rewrite_treespec(value)
            else:
                out[key] = _vet_model_json(value)
        return out
    if isinstance(obj, list):
        return [_vet_model_json(v) for v in obj]
    return obj


def _vet_payload_config(members: dict[str, bytes], name: str, what: str) -> None:
    body = members.get(name)
    if body is None:
        raise SourceUnreadable(f"{what}: {name} is missing", hint=_PT2_HINT)
    try:
        config = json.loads(body)["config"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise SourceUnreadable(f"{what}: {name} is not a payload config: {exc}") from exc
    for fqn, meta in config.items():
        if (
            not isinstance(meta, dict)
            or meta.get("use_pickle")
            or not str(meta.get("path_name", "")).startswith(("weight_", "tensor_"))
        ):
            raise UnsafeInput(
                f"{what}: {fqn!r} is stored as a Python pickle or custom object ({meta.get('path_name') if isinstance(meta, dict) else meta}); "
                "loading it would run arbitrary code",
                hint=_PT2_HINT,
            )


def check_pt2_archive(data: bytes, what: str = "torch.export archive") -> tuple[str, dict[str, bytes]]:
    """Vet a .pt2 and return (root, members) with every model JSON rewritten to its safe form.

    UNSAFE_INPUT for AOTInductor binaries, pickled weights/constants/custom objects, legacy
    pickled layouts, unsafe sample inputs and expressions or enum imports in the JSON.
    """
    import torch

    root, members = _read_members(data, what)
    if members.get("archive_format", b"").strip() != b"pt2":
        if "data.pkl" in members:
            raise UnsafeInput(f"{what} is a torch.save pickle, not a torch.export archive", hint=_PT2_HINT)
        raise UnsafeInput(
            f"{what} is not in the current .pt2 layout (no archive_format): older layouts store pickles",
            hint=_PT2_HINT,
        )
    if any(n.startswith("data/aotinductor/") for n in members):
        raise UnsafeInput(f"{what} holds AOTInductor compiled code (native shared libraries)", hint=_PT2_HINT)
    if any(n.endswith(".pkl") for n in members):
        raise UnsafeInput(
            f"{what} holds Python pickles ({[n for n in members if n.endswith('.pkl')][:3]})", hint=_PT2_HINT
        )
    models = [n[len("models/") : -len(".json")] for n in members if n.startswith("models/") and n.endswith(".json")]
    if "model" not in models:
        raise SourceUnreadable(f"{what} has no models/model.json", hint=_PT2_HINT)
    for model in models:
        for legacy in (f"data/weights/{model}.pt", f"data/constants/{model}.pt"):
            if legacy in members:
                raise UnsafeInput(f"{what} stores {legacy} as a pickle (legacy layout)", hint=_PT2_HINT)
        _vet_payload_config(members, f"data/weights/{model}_weights_config.json", what)
        _vet_payload_config(members, f"data/constants/{model}_constants_config.json", what)
        sample = members.get(f"data/sample_inputs/{model}.pt", b"")
        if sample:
            try:
                # weights_only is torch's allowlisting unpickler (tensors, containers, numbers):
                # torch itself would fall back to full unpickling when this fails.
                torch.load(io.BytesIO(sample), weights_only=True, map_location="cpu")
            except Exception as exc:
                raise UnsafeInput(
                    f"{what}: the example inputs of {model!r} are not plain tensors ({type(exc).__name__}); "
                    "torch would unpickle them with arbitrary code",
                    hint=_PT2_HINT,
                ) from exc
        key = f"models/{model}.json"
        try:
            program = json.loads(members[key])
        except json.JSONDecodeError as exc:
            raise SourceUnreadable(f"{what}: {key} is not JSON: {exc}") from exc
        program = _vet_model_json(program)
        # guards_code is Python source torch exec()s when the module first runs. Kiln checks
        # input shapes itself, so the guards are dropped rather than vetted.
        program["guards_code"] = []
        members[key] = json.dumps(program).encode()
    return root, members


@contextmanager
def _weights_only_loads() -> Iterator[None]:
    # Belt and braces: with this set, every torch.load inside torch.export.load is
    # weights-only even where torch passes weights_only=False.
    saved = {k: os.environ.get(k) for k in ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")}
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _check_graph_calls(program: Any) -> None:
    """Refuse a graph that calls anything but operators, higher-order ops and plain builtins."""
    import torch
    from torch._export.verifier import Verifier
    from torch._ops import HigherOrderOperator, OpOverload, OpOverloadPacket
    from torch.utils import _pytree as pytree

    builtins_ok = set(Verifier().allowed_builtin_ops())
    ops = (OpOverload, OpOverloadPacket, HigherOrderOperator)

    def allowed(fn: Any) -> bool:
        return isinstance(fn, ops) or fn in builtins_ok

    for gm in program.graph_module.modules():
        if not isinstance(gm, torch.fx.GraphModule):
            continue
        for node in gm.graph.nodes:
            if node.op in ("call_module", "call_method"):
                raise UnsafeInput(
                    f"the exported graph calls {node.op} {node.target!r}, which export never emits", hint=_PT2_HINT
                )
            if node.op == "call_function" and not allowed(node.target):
                raise UnsafeInput(
                    f"the exported graph calls {node.target!r}, which is not a torch operator", hint=_PT2_HINT
                )
            for arg in pytree.tree_leaves((node.args, node.kwargs)):
                if (
                    callable(arg)
                    and not isinstance(arg, (torch.Tensor, torch.fx.Node, torch.nn.Module))
                    and not allowed(arg)
                ):
                    raise UnsafeInput(f"the exported graph passes {arg!r} to {node.target!r}", hint=_PT2_HINT)


def load_exported_program(path: Path) -> torch.export.ExportedProgram:
    """Return the vetted ExportedProgram at ``path`` (see the module docstring for what is checked)."""
    import torch

    name = Path(path).name
    root, members = check_pt2_archive(Path(path).read_bytes(), name)
    try:
        with _weights_only_loads():
            program = torch.export.load(io.BytesIO(_repack(root, members)))
    except UnsafeInput:
        raise
    except Exception as exc:  # torch raises RuntimeError/AssertionError/SerializeError alike
        if type(exc).__name__ == "SpecViolationError":  # torch's verifier: a non-operator call
            raise UnsafeInput(f"{name}: {str(exc).splitlines()[0]}", hint=_PT2_HINT) from exc
        raise SourceUnreadable(
            f"torch.export.load cannot read {name}: {type(exc).__name__}: {exc}", hint=_PT2_HINT
        ) from exc
    program._guards_code = []  # already dropped from the JSON; keep it so if torch re-derives
    _check_graph_calls(program)
    return program
