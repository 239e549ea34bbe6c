"""Vet a TorchScript archive's code before torch compiles it: tensor operators only.

A TorchScript ``.pt`` is a zip whose ``code/`` holds the model as TorchScript source (Python
syntax), which ``torch.jit.load`` compiles and runs in TorchScript's interpreter. That
language cannot import Python modules, but it can call any operator registered in the
process: ``torch.from_file`` reads a file into a tensor, ``torch.save`` writes one,
``print`` writes to the process's output, and operators of other namespaces
(``torch.ops.c10d.*`` talks to other machines, ``torch.classes.*`` builds C++ objects) do
whatever their library does.

The check must see the code exactly as torch's own lexer does. Python's tokenizer and
torch's differ on input torch's serializer never writes (torch reads a comment up to
``\n`` only, takes any byte in it, and accepts tabs, form feeds and ``\r`` where Python
sees other tokens), so every ``code/`` file must first be in the form ``torch.jit.save``
writes (:func:`canonical_problem`): printable ASCII and newlines only, no comments, no
backslash continuations, no triple-quoted or prefixed strings. On that subset both lexers
cut the same tokens; anything else is refused (UNSAFE_INPUT) rather than guessed at.
:func:`vet_torchscript` then parses each file with Python's ``ast`` (the API needs no torch)
and allows only what the serializer writes for tensor programs:

- ``torch.<op>(...)`` and ``ops.aten.<op>`` / ``ops.prim.<op>``: ATen and prim operators,
  except the ones that touch files or print (:data:`DENIED_OPS`);
- calls of the archive's own functions, methods and TorchScript's builtins (``len``,
  ``range``, ``annotate``, ...);

and refuses with UNSAFE_INPUT, naming them: ``print``, the denied ATen ops, any other
operator namespace (``ops.<ns>``, ``torch.ops.<ns>``), ``torch.classes`` and ``torch``
used as a value. Where torch is installed (the workers), every function is parsed again by
torch's own parser (``torch._C._parse_source_def``), which must read the same function to
its end and find no name the ``ast`` walk did not judge. The archive's pickles are checked
when the model is loaded (services/runners/torch_archives.py).
"""

from __future__ import annotations

import ast
import importlib.util
import re
import textwrap
import tokenize
import zipfile
from io import StringIO
from pathlib import Path

from services.errors import SourceUnreadable, UnsafeInput
from services.formats.archives import ArchiveLimits

__all__ = [
    "ALLOWED_NAMESPACES",
    "DENIED_OPS",
    "canonical_problem",
    "torch_parser_problem",
    "torchscript_calls",
    "vet_torchscript",
]

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
#: The bytes torch.jit.save writes in code/: printable ASCII and newlines (strings are escaped).
_CANONICAL_BYTES = re.compile(rb"[\n\x20-\x7e]*")
_IDENT = re.compile(r"\(ident ([A-Za-z_][A-Za-z0-9_]*)\)")


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


def canonical_problem(data: bytes) -> str | None:
    """Return why ``data`` is not code as torch.jit.save writes it (where torch's lexer and Python's may differ), or None."""
    bad = _CANONICAL_BYTES.match(data)
    end = bad.end() if bad else 0
    if end != len(data):
        return f"byte 0x{data[end]:02x} at offset {end} (torch.jit.save writes printable ASCII and newlines only)"
    if b"\\\n" in data:
        return "a backslash line continuation"
    text = data.decode("ascii")
    try:
        for tok in tokenize.generate_tokens(StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                return f"a comment at line {tok.start[0]}"
            if tok.type == tokenize.STRING and (tok.string[:1] not in "'\"" or tok.string[:3] in ('"""', "'''")):
                return f"a prefixed or triple-quoted string at line {tok.start[0]}"
    except (tokenize.TokenError, SyntaxError) as exc:
        return f"text Python cannot tokenize ({exc})"
    return None


def _functions(tree: ast.Module) -> list[ast.FunctionDef]:
    """Return the module's functions and its classes' methods (what torch parses as functions)."""
    found: list[ast.FunctionDef] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            found.append(node)
        elif isinstance(node, ast.ClassDef):
            found.extend(n for n in node.body if isinstance(n, ast.FunctionDef))
    return found


def _judged_names(func: ast.FunctionDef) -> set[str]:
    names: set[str] = {func.name}
    for node in ast.walk(func):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            names.add(node.arg)
    return names


def torch_parser_problem(source: str, tree: ast.Module) -> str | None:
    """Return where torch's own parser reads a function of ``source`` differently from ``ast``, or None.

    Each function (the module's, and its classes' methods) is cut out by the lines ``ast`` gives
    it and parsed with ``torch._C._parse_source_def``: torch must read it whole, and every
    identifier in torch's tree must be one the ``ast`` walk saw (and so judged).
    """
    import torch

    lines = source.splitlines(keepends=True)
    for func in _functions(tree):
        text = textwrap.dedent("".join(lines[func.lineno - 1 : func.end_lineno]))
        try:
            parsed = torch._C._parse_source_def(text)
        except Exception as exc:  # torch cannot parse what ast accepted: they disagree
            return f"torch's parser does not read function {func.name} as Python does: {str(exc).strip()[:200]}"
        # torch's range ends at its last token: that must be on the function's last line.
        end = int(parsed.range().end)  # type: ignore[attr-defined]
        if "\n" in text[end:].rstrip():
            return f"torch's parser ends function {func.name} before its last line (at offset {end})"
        unseen = set(_IDENT.findall(str(parsed))) - _judged_names(func)
        if unseen:
            return f"torch's parser finds names in function {func.name} that Python does not: {sorted(unseen)[:5]}"
    return None


def _torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


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
        with_torch = _torch_available()
        for info in infos:
            name = info.filename.split("/code/", 1)[-1]
            try:
                data = zf.read(info)
            except (zipfile.BadZipFile, ValueError, OSError) as exc:
                raise SourceUnreadable(f"{path.name}: {info.filename} cannot be read: {exc}", hint=_HINT) from exc
            problem = canonical_problem(data)
            if problem is None:
                source = data.decode("ascii")
                try:
                    tree = ast.parse(source)
                    found = torchscript_calls(source)
                except (SyntaxError, RecursionError, ValueError, MemoryError) as exc:
                    problem = f"Python cannot parse it ({type(exc).__name__}: {exc})"
                else:
                    problem = torch_parser_problem(source, tree) if with_torch else None
            if problem is not None:
                raise UnsafeInput(
                    f"{path.name}: {info.filename} is not TorchScript code as torch.jit.save writes it, so Kiln "
                    f"cannot check it the way torch will read it: {problem}",
                    hint=_HINT,
                    files=[name],
                )
            for op in found:
                refused.setdefault(op, set()).add(name)
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
