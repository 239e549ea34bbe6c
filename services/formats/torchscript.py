"""Vet a TorchScript archive's code before torch compiles it: tensor operators only.

A TorchScript ``.pt`` is a zip whose ``code/`` holds the model as TorchScript source (Python
syntax), which ``torch.jit.load`` compiles and runs in TorchScript's interpreter. That
language cannot import Python modules, but it can call any operator registered in the
process: ``torch.from_file`` reads a file into a tensor, ``torch.save`` writes one,
``print`` writes to the process's output, and operators of other namespaces
(``torch.ops.c10d.*`` talks to other machines, ``torch.classes.*`` builds C++ objects) do
whatever their library does. :func:`vet_torchscript` parses every ``code/`` file with
Python's ``ast`` (no torch import) and allows only what the serializer writes for tensor
programs:

- ``torch.<op>(...)`` and ``ops.aten.<op>`` / ``ops.prim.<op>``: ATen and prim operators,
  except the ones that touch files or print (:data:`DENIED_OPS`);
- calls of the archive's own functions, methods and TorchScript's builtins (``len``,
  ``range``, ``annotate``, ...);

and refuses with UNSAFE_INPUT, naming them: ``print``, the denied ATen ops, any other
operator namespace (``ops.<ns>``, ``torch.ops.<ns>``), ``torch.classes`` and ``torch``
used as a value. The archive's pickles are checked when the model is loaded
(services/runners/torch_archives.py).
"""

from __future__ import annotations

import ast
import zipfile
from pathlib import Path

from services.errors import SourceUnreadable, UnsafeInput
from services.formats.archives import ArchiveLimits

__all__ = ["ALLOWED_NAMESPACES", "DENIED_OPS", "torchscript_calls", "vet_torchscript"]

#: Operator namespaces a vetted TorchScript program may call: tensor math and control flow.
ALLOWED_NAMESPACES = frozenset({"aten", "prim"})
#: ATen and prim operators that read or write files or print (every schema with a file argument;
#: tests/test_torchscript_vetting.py checks this against the installed torch's operator registry).
DENIED_OPS = frozenset({"aten::save", "aten::from_file", "prim::Print"})
#: Names TorchScript resolves to the printing operator.
_PRINT_NAMES = frozenset({"print"})
_HINT = (
    "Kiln compiles TorchScript that computes on tensors only: remove file reads and writes "
    "(torch.from_file, torch.save), print() and custom operators or classes from forward(), "
    "and save it again with torch.jit.trace(model, example).save(path) or torch.jit.script(model).save(path)."
)
_LIMITS = ArchiveLimits()
_MAX_CODE_BYTES = 256 << 20


def _chain(node: ast.expr) -> list[str] | None:
    """Return ``a.b.c`` as ``["a", "b", "c"]`` when ``node`` is a plain attribute chain on a name."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return parts[::-1]
    return None


def _refusal(chain: list[str], called: bool) -> str | None:
    """Return what a ``torch.*`` / ``ops.*`` chain does that vetting refuses, or None."""
    if chain[0] == "__torch__":
        chain = chain[1:]  # type annotations: __torch__.torch.classes.<ns>.<Class>
        if not chain or chain[0] != "torch":
            return None
    if chain[0] == "ops":
        chain = ["torch", *chain]
    if chain[0] != "torch":
        return None
    if len(chain) == 1:
        return "torch used as a value"
    if chain[1] == "classes":
        return "torch.classes." + ".".join(chain[2:]) if len(chain) > 2 else "torch.classes"
    if chain[1] == "ops":
        if len(chain) < 4:
            return "torch.ops used as a value" if called else None
        ns, op = chain[2], chain[3]
        if ns not in ALLOWED_NAMESPACES:
            return f"{ns}::{op}"
        return f"{ns}::{op}" if f"{ns}::{op}" in DENIED_OPS else None
    if len(chain) == 2:  # torch.<op>: an ATen (or prim) operator
        for ns in ALLOWED_NAMESPACES:
            if f"{ns}::{chain[1]}" in DENIED_OPS:
                return f"{ns}::{chain[1]}"
    return None


def torchscript_calls(source: str) -> set[str]:
    """Return what one ``code/`` file does that vetting refuses (operator names, ``print``, ...)."""
    tree = ast.parse(source)
    refused: set[str] = set()
    inside: set[int] = set()  # names and attributes already judged as part of a longer chain
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _PRINT_NAMES:
            refused.add("prim::Print")
        if not isinstance(node, ast.Attribute) or id(node) in inside:
            continue
        chain = _chain(node)
        sub: ast.expr = node
        while isinstance(sub, ast.Attribute):
            inside.add(id(sub))
            sub = sub.value
        inside.add(id(sub))
        if chain is not None:
            reason = _refusal(chain, called=False)
            if reason:
                refused.add(reason)
    for node in ast.walk(tree):  # a bare torch/ops not at the root of a chain is a value
        if isinstance(node, ast.Name) and node.id in ("torch", "ops") and id(node) not in inside:
            refused.add(f"{node.id} used as a value")
    return refused


def vet_torchscript(path: Path) -> None:
    """Refuse (UNSAFE_INPUT) a TorchScript archive whose code does more than compute on tensors."""
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as exc:
        raise SourceUnreadable(f"{path.name} is not a readable zip archive: {exc}") from exc
    with zf:
        infos = [i for i in zf.infolist() if "/code/" in f"/{i.filename}" and i.filename.endswith(".py")]
        if len(zf.infolist()) > _LIMITS.max_members or sum(i.file_size for i in infos) > _MAX_CODE_BYTES:
            raise UnsafeInput(f"{path.name} holds more code than a TorchScript model does", hint=_HINT)
        refused: dict[str, set[str]] = {}
        for info in infos:
            try:
                source = zf.read(info).decode("utf-8")
                found = torchscript_calls(source)
            except (SyntaxError, UnicodeDecodeError, RecursionError, zipfile.BadZipFile, ValueError) as exc:
                raise SourceUnreadable(
                    f"{path.name}: {info.filename} is not TorchScript source: {type(exc).__name__}: {exc}",
                    hint=_HINT,
                ) from exc
            for op in found:
                refused.setdefault(op, set()).add(info.filename.split("/code/", 1)[-1])
    if refused:
        ops = sorted(refused)
        files = sorted({f for where in refused.values() for f in where})
        raise UnsafeInput(
            f"{path.name}: its TorchScript code calls what Kiln does not run on uploads (file, printing or "
            f"non-tensor operators): {', '.join(ops)} (in {', '.join(files[:5])})",
            hint=_HINT,
            ops=ops,
            files=files[:20],
        )
