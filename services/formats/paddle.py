"""PaddlePaddle inference models: recognise them from content and vet them before Paddle reads them.

An inference model is a program file and a parameters file with the same stem:

- ``model.pdmodel``: the legacy ProgramDesc protobuf (``paddle.jit.save`` before Paddle 3,
  or with ``FLAGS_enable_pir_api=0``); OpenVINO's Paddle frontend reads it directly.
- ``model.json``: the PIR program Paddle 3.x writes by default (``{"base_code": {"magic":
  "pir"}, "program": ...}``); only Paddle and paddle2onnx read it (OpenVINO 2026 does not:
  "Cannot recognize input model").
- ``model.pdiparams``: the weights, ``save_combine``'s stream of serialized tensors.

Both are data, but a program may hold operators that touch the file system or the network
when run (``save``, ``load``, ``read_file``, ``send``/``recv``, collective ``c_*``...) or
call back into Python (``py_func``). Every operator must be on an allowlist of tensor
computations (services/formats/paddle_ops.py; for PIR, per dialect), everything else is
refused with UNSAFE_INPUT, naming them, before any framework reads the file. ``model.pdiparams.info`` (a Python pickle ``paddle.jit.save``
writes beside them) is never read: loaders only see a private copy of the program and
its parameters (:func:`stage_paddle_model`).

Everything here is pure Python: the API detects and vets without importing Paddle.
"""

from __future__ import annotations

import json
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path

from services.errors import SourceUnreadable, UnsafeInput
from services.formats._types import Format
from services.formats.paddle_ops import ALLOWED_PADDLE_OPS, ALLOWED_PIR_OPS, PIR_DIALECTS

__all__ = [
    "PADDLE",
    "PADDLE_PARAMS_SUFFIX",
    "PADDLE_PIR",
    "PaddleModel",
    "find_paddle_model",
    "paddle_kind_of_members",
    "pdmodel_program",
    "pir_program",
    "sniff_pdmodel",
    "sniff_pdmodel_members",
    "sniff_pir",
    "sniff_pir_members",
    "stage_paddle_model",
    "vet_paddle_model",
]

#: The two Paddle formats (registered in services/descriptors/paddle.py).
PADDLE = Format("paddle")
PADDLE_PIR = Format("paddle_pir")
PADDLE_PARAMS_SUFFIX = ".pdiparams"
_PADDLE_PROGRAM_SUFFIX = ".pdmodel"
_PROGRAM_SUFFIXES = {_PADDLE_PROGRAM_SUFFIX: PADDLE, ".json": PADDLE_PIR}

#: Paddle's VarType codes for tensor element types -> bytes per element.
_DTYPE_BYTES = {0: 1, 1: 2, 2: 4, 3: 8, 4: 2, 5: 4, 6: 8, 19: 8, 20: 1, 21: 1, 22: 2, 23: 8, 24: 16, 32: 1, 33: 1}
_DTYPE_NAMES = {0: "bool", 1: "int16", 2: "int32", 3: "int64", 4: "float16", 5: "float32", 6: "float64", 20: "uint8"}
_DTYPE_NAMES |= {21: "int8", 22: "bfloat16", 23: "complex64", 24: "complex128", 19: "size_t"}
_DTYPE_NAMES |= {32: "float8_e4m3fn", 33: "float8_e5m2"}

_UPLOAD_HINT = (
    "Upload the inference model as a directory or archive holding the program (model.json or "
    "model.pdmodel) and its model.pdiparams, as paddle.jit.save writes them."
)


@dataclass(frozen=True)
class PaddleModel:
    """A vetted Paddle inference model: program, parameters and what vetting found."""

    format: Format
    program: Path
    params: Path
    ops: dict[str, int]
    tensors: int
    #: Declared dtype and shape (None: dynamic) of every variable the program names, for the
    #: runner's input and output specs (Paddle's predictor knows them only after a run).
    shapes: dict[str, tuple[str, tuple[int | None, ...]]] = field(default_factory=dict)


# --------------------------------------------------------------------------- protobuf wire


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _fields(buf: bytes) -> list[tuple[int, int, int | bytes]]:
    """Return the (field, wire type, value) triples of one protobuf message; ValueError when malformed."""
    out: list[tuple[int, int, int | bytes]] = []
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if field == 0:
            raise ValueError("field number 0")
        if wire == 0:
            value, pos = _varint(buf, pos)
            out.append((field, wire, value))
        elif wire == 1:
            pos += 8
        elif wire == 2:
            size, pos = _varint(buf, pos)
            if pos + size > len(buf):
                raise ValueError("length-delimited field runs past the end")
            out.append((field, wire, buf[pos : pos + size]))
            pos += size
        elif wire == 5:
            pos += 4
        else:
            raise ValueError(f"wire type {wire}")
        if pos > len(buf):
            raise ValueError("field runs past the end")
    return out


Shapes = dict[str, tuple[str, tuple[int | None, ...]]]


def _signed(d: int) -> int:
    return d - (1 << 64) if d >= 1 << 63 else d


def _tensor_desc(buf: bytes) -> tuple[int, list[int]]:
    """Return (VarType data type, dims) of a TensorDesc (``data_type = 1``, ``dims = 2``, packed or not)."""
    dtype, dims = -1, []
    for f, w, v in _fields(buf):
        if f == 1 and w == 0:
            dtype = int(v)  # type: ignore[arg-type]
        elif f == 2 and w == 0:
            dims.append(_signed(int(v)))  # type: ignore[arg-type]
        elif f == 2 and w == 2:
            packed, pos = bytes(v), 0  # type: ignore[arg-type]
            while pos < len(packed):
                d, pos = _varint(packed, pos)
                dims.append(_signed(d))
    return dtype, dims


def _var_shape(var_type: bytes) -> tuple[str, tuple[int | None, ...]] | None:
    """Return (dtype, shape) of a dense VarType (``lod_tensor = 3`` -> ``tensor = 1``), else None."""
    for f, w, v in _fields(var_type):
        if f == 3 and w == 2:
            for ff, ww, vv in _fields(bytes(v)):  # type: ignore[arg-type]
                if ff == 1 and ww == 2:
                    dtype, dims = _tensor_desc(bytes(vv))  # type: ignore[arg-type]
                    return _DTYPE_NAMES.get(dtype, "float32"), tuple(d if d >= 0 else None for d in dims)
    return None


def _program_desc(data: bytes, shapes: Shapes) -> tuple[dict[str, int], int]:
    """Return (op type histogram, persistable variables) of a ProgramDesc; fill ``shapes``.

    ProgramDesc: ``blocks = 1`` (BlockDesc: ``vars = 3``, ``ops = 4``); OpDesc: ``type = 3``;
    VarDesc: ``name = 1``, ``type = 2``, ``persistable = 3``.
    """
    ops: dict[str, int] = {}
    persistable: set[str] = set()
    blocks = [v for f, w, v in _fields(data) if f == 1 and w == 2]
    if not blocks:
        raise ValueError("no blocks")
    for block in blocks:
        assert isinstance(block, bytes)
        for f, w, v in _fields(block):
            if w != 2:
                continue
            assert isinstance(v, bytes)
            if f == 4:
                names = [t for ff, ww, t in _fields(v) if ff == 3 and ww == 2]
                if not names:
                    raise ValueError("an operator without a type")
                op = bytes(names[0]).decode("utf-8", "replace")  # type: ignore[arg-type]
                ops[op] = ops.get(op, 0) + 1
            elif f == 3:
                fields = _fields(v)
                name = next((bytes(t).decode("utf-8", "replace") for ff, ww, t in fields if ff == 1 and ww == 2), "")  # type: ignore[arg-type]
                if any(ff == 3 and ww == 0 and t for ff, ww, t in fields) and name not in ("feed", "fetch"):
                    persistable.add(name)
                var_type = next((bytes(t) for ff, ww, t in fields if ff == 2 and ww == 2), b"")  # type: ignore[arg-type]
                shape = _var_shape(var_type) if var_type else None
                if name and shape is not None:
                    shapes[name] = shape
    return ops, len(persistable)


def _pir_attr(node: dict[str, object], name: str) -> object:
    for attr in node.get("A") or []:  # type: ignore[attr-defined]
        if isinstance(attr, dict) and attr.get("N") == name:
            return (attr.get("AT") or {}).get("D")
    return None


def _pir_shape(node: dict[str, object]) -> tuple[str, tuple[int | None, ...]] | None:
    """Return (dtype, shape) of a PIR op's first output ("O" -> "TT" -> "D": [dtype, dims, ...])."""
    out = node.get("O")
    out = out[0] if isinstance(out, list) and out else out
    try:
        dtype, dims = out["TT"]["D"][0]["#"], out["TT"]["D"][1]  # type: ignore[index]
        names = {"0.t_f32": "float32", "0.t_f16": "float16", "0.t_f64": "float64", "0.t_i64": "int64"}
        names |= {"0.t_i32": "int32", "0.t_bool": "bool", "0.t_ui8": "uint8", "0.t_i8": "int8", "0.t_bf16": "bfloat16"}
        return names.get(dtype, "float32"), tuple(int(d) if int(d) >= 0 else None for d in dims)
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def _pir_ops(data: bytes, shapes: Shapes, refused: set[str] | None = None) -> tuple[dict[str, int], int]:
    """Return (op histogram without dialect prefixes, parameter ops) of a PIR program in JSON; fill ``shapes``.

    ``refused`` collects ``dialect.op`` for every operator outside :data:`ALLOWED_PIR_OPS` (an
    unknown dialect number included).
    """
    doc = json.loads(data)
    if not isinstance(doc, dict) or (doc.get("base_code") or {}).get("magic") != "pir":
        raise ValueError("not a PIR program (no base_code.magic == 'pir')")
    ops: dict[str, int] = {}
    params = 0
    stack: list[object] = [doc.get("program")]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            raw = node.get("#")
            name = raw if isinstance(raw, str) else ""
            # Types ("0.t_f32") and attributes ("1.a_intarray") share the "#" key with operators;
            # everything else named "<dialect>.<name>" is an operator, wherever it sits.
            number, dot, op = name.rpartition(".")
            if name == "p":
                params += 1
            elif dot and not op.startswith(("t_", "a_")) and not name.startswith(("block_", "region_")):
                ops[op] = ops.get(op, 0) + 1
                dialect = PIR_DIALECTS.get(number)
                if refused is not None and (dialect is None or op not in ALLOWED_PIR_OPS[dialect]):
                    refused.add(f"{dialect or number}.{op}")
                if op in ("data", "fetch"):
                    var = _pir_attr(node, "name")
                    shape = _pir_shape(node)
                    if isinstance(var, str) and shape is not None:
                        shapes[var] = shape
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    if not ops:
        raise ValueError("the program has no operators")
    return ops, params


def _params_tensors(path: Path) -> int:
    """Return how many tensors a ``save_combine`` file holds; ValueError when it is malformed or truncated.

    Each tensor: uint32 version (0), uint64 LoD levels (each: uint64 byte size + offsets),
    uint32 tensor version (0), int32 TensorDesc size, the TensorDesc protobuf (``data_type = 1``,
    ``dims = 2``), then the raw elements.
    """
    size = path.stat().st_size
    count = 0
    with open(path, "rb") as f:

        def read(n: int) -> bytes:
            chunk = f.read(n)
            if len(chunk) != n:
                raise ValueError(f"ends inside tensor {count} (wanted {n} more bytes at offset {f.tell()})")
            return chunk

        while f.tell() < size:
            (version,) = struct.unpack("<I", read(4))
            if version != 0:
                raise ValueError(f"tensor {count} has version {version}, not 0")
            (levels,) = struct.unpack("<Q", read(8))
            if levels > 16:
                raise ValueError(f"tensor {count} claims {levels} LoD levels")
            for _ in range(levels):
                (nbytes,) = struct.unpack("<Q", read(8))
                if f.tell() + nbytes > size:
                    raise ValueError(f"tensor {count}'s LoD runs past the end")
                f.seek(nbytes, 1)
            (tversion,) = struct.unpack("<I", read(4))
            if tversion != 0:
                raise ValueError(f"tensor {count} has tensor version {tversion}, not 0")
            (desc_size,) = struct.unpack("<i", read(4))
            if not 0 < desc_size < 1 << 16:
                raise ValueError(f"tensor {count} has a descriptor of {desc_size} bytes")
            desc = _fields(read(desc_size))
            dtypes = [v for fl, w, v in desc if fl == 1 and w == 0]
            if not dtypes or dtypes[0] not in _DTYPE_BYTES:
                raise ValueError(f"tensor {count} has an unknown element type {dtypes[:1]}")
            dims: list[int] = []
            for fl, w, v in desc:
                if fl != 2:
                    continue
                if w == 0:
                    dims.append(int(v))  # type: ignore[arg-type]
                elif w == 2:
                    packed, pos = bytes(v), 0  # type: ignore[arg-type]
                    while pos < len(packed):
                        d, pos = _varint(packed, pos)
                        dims.append(d)
            numel = 1
            for d in dims:
                if d >= 1 << 62:  # a negative int64 on the wire
                    raise ValueError(f"tensor {count} has a negative dimension")
                numel *= d
            nbytes = numel * _DTYPE_BYTES[int(dtypes[0])]  # type: ignore[arg-type]
            if f.tell() + nbytes > size:
                raise ValueError(
                    f"tensor {count} ({_DTYPE_NAMES.get(int(dtypes[0]), '?')}{dims}) needs {nbytes} bytes, "  # type: ignore[arg-type]
                    f"{size - f.tell()} left"
                )
            f.seek(nbytes, 1)
            count += 1
    return count


# --------------------------------------------------------------------------- detection


def _program_kind(name: str) -> Format | None:
    for suffix, fmt in _PROGRAM_SUFFIXES.items():
        if name.endswith(suffix):
            return fmt
    return None


def paddle_kind_of_members(members: list[str]) -> tuple[Format, str] | None:
    """Return the Paddle format an archive or directory listing holds, or None.

    A program counts only with a ``.pdiparams`` of the same stem beside it: a lone
    ``config.json`` is not a Paddle model.
    """
    names = set(members)
    for m in sorted(members):
        fmt = _program_kind(m)
        if fmt is None:
            continue
        stem = m.rsplit(".", 1)[0]
        if stem + PADDLE_PARAMS_SUFFIX in names:
            what = "PIR program (.json)" if fmt is PADDLE_PIR else "ProgramDesc (.pdmodel)"
            return fmt, f"PaddlePaddle inference model: {what} + {stem.rsplit('/', 1)[-1]}{PADDLE_PARAMS_SUFFIX}"
    return None


def _kind_of_path(path: Path) -> tuple[Format, str] | None:
    if path.is_dir():
        return paddle_kind_of_members([p.name for p in path.iterdir() if p.is_file()])
    with open(path, "rb") as f:
        head = f.read(64)
    if path.suffix in (_PADDLE_PROGRAM_SUFFIX, PADDLE_PARAMS_SUFFIX) or head.startswith(b'{"base_code"'):
        raise SourceUnreadable(
            f"{path.name} is one file of a PaddlePaddle inference model; its program and parameters come as a pair",
            hint="Upload the directory, or a .zip/.tar.gz, holding model.json (or model.pdmodel) and model.pdiparams.",
        )
    return None


def _seen_if(found: tuple[Format, str] | None, fmt: Format) -> str | None:
    return found[1] if found is not None and found[0] is fmt else None


def sniff_pdmodel(path: Path) -> str | None:
    """Return what was seen when ``path`` (a directory) holds a .pdmodel and its .pdiparams, else None.

    A lone program or parameters file raises SOURCE_UNREADABLE: the pair is the model.
    """
    return _seen_if(_kind_of_path(path), PADDLE)


def sniff_pir(path: Path) -> str | None:
    """Return what was seen when ``path`` (a directory) holds a PIR model.json and its .pdiparams, else None."""
    return _seen_if(_kind_of_path(path), PADDLE_PIR)


def sniff_pdmodel_members(members: list[str]) -> str | None:
    """Return what was seen when an archive's ``members`` hold a .pdmodel and its .pdiparams, else None."""
    return _seen_if(paddle_kind_of_members(members), PADDLE)


def sniff_pir_members(members: list[str]) -> str | None:
    """Return what was seen when an archive's ``members`` hold a PIR .json and its .pdiparams, else None."""
    return _seen_if(paddle_kind_of_members(members), PADDLE_PIR)


def pdmodel_program(root: Path) -> Path:
    """Return the vetted .pdmodel program under ``root`` (refusing a malformed or unsafe one at submission)."""
    return vet_paddle_model(find_paddle_model(root, PADDLE)[0], PADDLE).program


def pir_program(root: Path) -> Path:
    """Return the vetted PIR .json program under ``root`` (refusing a malformed or unsafe one at submission)."""
    return vet_paddle_model(find_paddle_model(root, PADDLE_PIR)[0], PADDLE_PIR).program


def find_paddle_model(root: Path, fmt: Format) -> tuple[Path, Path]:
    """Return the (program, parameters) pair of format ``fmt`` under ``root`` (a directory or the program)."""
    if root.is_file():
        program = root
    else:
        suffix = next(s for s, f in _PROGRAM_SUFFIXES.items() if f is fmt)
        hits = [p for p in sorted(root.rglob("*" + suffix)) if p.with_suffix(PADDLE_PARAMS_SUFFIX).is_file()]
        if not hits:
            raise SourceUnreadable(f"no {suffix} program with a {PADDLE_PARAMS_SUFFIX} beside it", hint=_UPLOAD_HINT)
        if len(hits) > 1:
            raise SourceUnreadable(
                f"{len(hits)} Paddle programs in one upload: {[p.name for p in hits[:4]]}",
                hint="Upload one inference model (one program and its .pdiparams) per job.",
            )
        program = hits[0]
    params = program.with_suffix(PADDLE_PARAMS_SUFFIX)
    if not params.is_file():
        raise SourceUnreadable(f"Paddle program {program.name} has no {params.name} beside it", hint=_UPLOAD_HINT)
    return program, params


def vet_paddle_model(program: Path, fmt: Format | None = None) -> PaddleModel:
    """Read the program and parameters as data and refuse what Kiln must not hand to Paddle.

    SOURCE_UNREADABLE for a malformed or truncated program or parameters file (naming the
    first inconsistency), UNSAFE_INPUT for file, network or Python-callback operators.
    """
    program, params = find_paddle_model(program, fmt or _program_kind(program.name) or PADDLE)
    fmt = _program_kind(program.name)
    if fmt is None:
        raise SourceUnreadable(f"{program.name} is not a Paddle program (.pdmodel or .json)", hint=_UPLOAD_HINT)
    data = program.read_bytes()
    shapes: Shapes = {}
    pir_refused: set[str] = set()
    try:
        ops, declared = _pir_ops(data, shapes, pir_refused) if fmt is PADDLE_PIR else _program_desc(data, shapes)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        kind = "PIR JSON program" if fmt is PADDLE_PIR else "ProgramDesc protobuf"
        raise SourceUnreadable(
            f"{program.name} is not a readable Paddle {kind}: {exc}",
            hint="The file may be truncated or not a Paddle inference program; save it again with paddle.jit.save.",
        ) from exc
    unsafe = sorted(pir_refused if fmt is PADDLE_PIR else {op for op in ops if op not in ALLOWED_PADDLE_OPS})
    if unsafe:
        raise UnsafeInput(
            f"{program.name} holds operators outside the ones Kiln runs on uploads (tensor computations; "
            f"no file, printing, Python, communication or training operators): {unsafe}",
            hint="Export an inference program (paddle.jit.save of the model in eval mode) without I/O, "
            "communication or py_func operators. services/formats/paddle_ops.py lists what is allowed.",
            ops=unsafe,
        )
    try:
        tensors = _params_tensors(params)
    except (ValueError, struct.error) as exc:
        raise SourceUnreadable(
            f"{params.name} is not a readable Paddle parameters file: {exc}",
            hint="The file may be truncated; upload the .pdiparams paddle.jit.save wrote with this program.",
        ) from exc
    if declared and tensors != declared:
        raise SourceUnreadable(
            f"{params.name} holds {tensors} tensors but {program.name} declares {declared} parameters",
            hint="The parameters belong to another program; upload the pair paddle.jit.save wrote together.",
        )
    return PaddleModel(fmt, program, params, dict(sorted(ops.items())), tensors, shapes)


def stage_paddle_model(model: PaddleModel, dest: Path) -> PaddleModel:
    """Copy only the program and parameters into ``dest`` (nothing else beside them is ever read)."""
    dest.mkdir(parents=True, exist_ok=True)
    program = dest / ("model" + model.program.suffix)
    params = dest / ("model" + PADDLE_PARAMS_SUFFIX)
    for src, dst in ((model.program, program), (model.params, params)):
        if not dst.exists():
            shutil.copyfile(src, dst)
    return PaddleModel(model.format, program, params, model.ops, model.tensors, model.shapes)
