"""``model_cuda.so`` that loads in milliseconds: its kernels compiled to a cubin here and embedded.

TVM's PyPI wheel is built without CUDA, so the CUDA library ``tvm.compile`` makes holds its kernels
as CUDA C (module format ``cuda``), which TVM's CUDA runtime hands to NVRTC every time the library
is loaded: measured on an H200, 2.5 s for a tiny CNN and 9.8 s for a small ResNet, and a serving
box that needs NVRTC and ``cuda-bindings``. Here the kernels are compiled once, at build time, for
the spec's ``cuda_arch``: with nvcc (on PATH, or the ``nvidia-cuda-nvcc`` wheel's), or with NVRTC
(TVM's own ``compile_cuda`` over ``cuda-bindings``) where nvcc is missing. The library's packed
module blob (``__tvm_ffi__library_bin``) is then written with the CUDA module in format ``cubin``
and the cubin as its data, so TVM's runtime loads it with ``cuModuleLoadData``: the driver and
``libcudart`` are all it needs.

The blob is tvm-ffi's: ``u64 size``, the import tree (two ``u64``-counted vectors), then per module
its type key (``u64``-length string) and, except for the host library ``_lib``, its bytes. A CUDA
module's bytes are its format (string), its function table, and its data (string), last.
:func:`embedded_cuda` reads them back from a ``.so`` (what the tests and the version's manifest use).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import struct
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.errors import ConversionFailed, EngineUnavailable

__all__ = ["CudaImage", "build_cuda_library", "cubin_arch", "embedded_cuda", "find_nvcc"]

BLOB_SYMBOL = "__tvm_ffi__library_bin"
_EM_CUDA = 190  # ELF e_machine of a cubin


@dataclass(frozen=True)
class CudaImage:
    """A CUDA module packed into a library: its format and, for a cubin, the architecture it runs on."""

    fmt: str  # "cubin" (loads with the driver alone) or "cuda" (CUDA C: NVRTC compiles it at load)
    size: int
    arch: str | None  # "sm_90" for a cubin
    kernels: int  # functions in its table

    def to_dict(self) -> dict[str, Any]:
        return {"format": self.fmt, "bytes": self.size, "arch": self.arch, "kernels": self.kernels}


def find_nvcc() -> str | None:
    """Return nvcc: on PATH, else the ``nvidia-cuda-nvcc`` wheel's (``nvidia/cu*/bin/nvcc``), else None."""
    found = shutil.which("nvcc")
    if found:
        return found
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for candidate in sorted(Path(root).glob("cu*/bin/nvcc"), reverse=True):
            if os.access(candidate, os.X_OK):
                return str(candidate)
    return None


def cubin_arch(cubin: bytes) -> str | None:
    """Return the ``sm_XX`` a cubin's ELF header names (None: not a cubin)."""
    if len(cubin) < 52 or cubin[:4] != b"\x7fELF" or struct.unpack_from("<H", cubin, 18)[0] != _EM_CUDA:
        return None
    flags = struct.unpack_from("<I", cubin, 48)[0]
    # CUDA 12.8+ (ELF ABI version 8) moved the SM number from the low byte to the next one.
    sm = (flags >> 8) & 0xFF if cubin[8] >= 8 else flags & 0xFF
    return f"sm_{sm}"


def _compile_nvcc(nvcc: str, source: str, arch: str, scratch: Path) -> tuple[bytes, str]:
    cu, cubin = scratch / "kernels.cu", scratch / "kernels.cubin"
    cu.write_text(source)
    proc = subprocess.run(
        [nvcc, "--cubin", f"-arch={arch}", "-O3", "-o", str(cubin), str(cu)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0:
        raise ConversionFailed(
            f"nvcc cannot compile the CUDA kernels TVM generated for {arch}",
            tool="nvcc",
            output=(proc.stderr or proc.stdout)[-4000:],
        )
    said = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    version = re.search(r"release [0-9.]+, V([0-9.]+)", said)
    return cubin.read_bytes(), f"nvcc {version.group(1) if version else '?'}"


def _compile_nvrtc(source: str, arch: str) -> tuple[bytes, str]:
    try:
        from tvm.support.nvcc import compile_cuda
    except ImportError as exc:
        raise EngineUnavailable(f"TVM's CUDA compiler support is missing: {exc}") from exc
    try:
        cubin = compile_cuda(source, target_format="cubin", arch=arch, compiler="nvrtc")
    except ImportError as exc:
        raise EngineUnavailable(
            f"neither nvcc nor NVRTC is here to compile the CUDA kernels for {arch} ({exc})",
            hint="Install the nvidia-cuda-nvcc wheel (Kiln's tvm extra has it), or cuda-bindings with "
            "nvidia-cuda-nvrtc, on the tvm worker.",
        ) from exc
    except Exception as exc:
        raise ConversionFailed(
            f"NVRTC cannot compile the CUDA kernels TVM generated for {arch}", tool="nvrtc", output=str(exc)[-4000:]
        ) from exc
    return bytes(cubin), "nvrtc"


def _u64(data: bytes, at: int) -> tuple[int, int]:
    return struct.unpack_from("<Q", data, at)[0], at + 8


def _modules(blob: bytes) -> tuple[int, list[tuple[str, int, int]]]:
    """Return where the module list starts and each module's (type key, payload start, payload end)."""
    at = 8  # the blob's own size
    for _ in range(2):  # the import tree's row pointers, then its child indices
        count, at = _u64(blob, at)
        at += 8 * count
    start = at
    out = []
    while at < len(blob):
        n, at = _u64(blob, at)
        key = blob[at : at + n].decode()
        at += n
        if key == "_lib":
            out.append((key, at, at))
            continue
        n, at = _u64(blob, at)
        out.append((key, at, at + n))
        at += n
    return start, out


def _cuda_payload(payload: bytes) -> tuple[str, bytes, bytes]:
    """Split a CUDA module's bytes into (format, function table bytes, data)."""
    n, at = _u64(payload, 0)
    fmt = payload[at : at + n].decode()
    at += n
    # The data is the last string: find the u64 length that runs exactly to the end.
    for cut in range(len(payload) - 8, at - 1, -1):
        if struct.unpack_from("<Q", payload, cut)[0] == len(payload) - cut - 8:
            return fmt, payload[at:cut], payload[cut + 8 :]
    raise ValueError("not a CUDA module: no data field")


def _string(value: bytes) -> bytes:
    return struct.pack("<Q", len(value)) + value


def embed_cubin(blob: bytes, cubin: bytes) -> bytes:
    """Return the packed-module blob with its CUDA module's CUDA C replaced by ``cubin`` (format ``cubin``)."""
    start, modules = _modules(blob)
    out = bytearray(blob[8:start])
    replaced = 0
    for key, lo, hi in modules:
        out += _string(key.encode())
        if key == "_lib":
            continue
        payload = blob[lo:hi]
        if key == "cuda":
            fmt, table, _source = _cuda_payload(payload)
            if fmt == "cuda":
                payload = _string(b"cubin") + table + _string(cubin)
                replaced += 1
        out += _string(payload)
    if replaced != 1:
        raise ConversionFailed(f"the CUDA build packs {replaced} CUDA C modules, Kiln embeds exactly one", tool="tvm")
    return struct.pack("<Q", len(out)) + bytes(out)


def _pack_with_cubin(cubin: bytes) -> Callable[..., str]:
    """Return an ``fpack_imports`` for ``export_library``: TVM's packed C, the CUDA module swapped for ``cubin``."""

    def pack(module: Any, is_system_lib: bool, prefix: str, workspace: str) -> str:
        import tvm_ffi

        text = tvm_ffi.get_global_func("runtime.ModulePackImportsToC")(module, is_system_lib, prefix)
        head, sep, rest = text.partition(f"{BLOB_SYMBOL}[")
        array = re.search(r"\] = \{(.*?)\};", rest, re.S)
        if not sep or array is None:
            raise ConversionFailed("TVM's packed-import C source has an unexpected layout", tool="tvm")
        blob = bytes(int(b, 16) for b in re.findall(r"0x([0-9a-fA-F]{2})", array.group(1)))
        packed = embed_cubin(blob, cubin)
        rows = ",\n".join(",".join(f"0x{b:02x}" for b in packed[i : i + 20]) for i in range(0, len(packed), 20))
        body = f"{head}{BLOB_SYMBOL}[{len(packed)}] = {{\n{rows}\n}};{rest[array.end() :]}"
        path = Path(workspace) / f"{prefix}devc.c"
        path.write_text(body)
        return str(path)

    return pack


def build_cuda_library(
    mod: Any, arch: str, out_path: Path, scratch: Path, progress: Callable[[str], None] = lambda _m: None
) -> dict[str, Any]:
    """Compile ``mod`` for CUDA ``arch`` into ``out_path`` with its kernels as an embedded cubin; return what was built."""
    import tvm

    target = tvm.target.Target({"kind": "cuda", "arch": arch}, host={"kind": "llvm"})
    library = tvm.compile(mod, target=target)  # GPU kernels get TVM's default GPU schedules
    host = library.mod.imports[0] if library.mod.imports else None
    cuda = [m for m in host.imports if m.kind == "cuda"] if host is not None else []
    if not cuda:
        raise ConversionFailed("the CUDA build holds no CUDA module", tool="tvm.compile")
    # Built without a CUDA driver the module keeps CUDA C; it answers it under its own format name,
    # which is the empty one in TVM 0.27.
    source = cuda[0].inspect_source("cu") or cuda[0].inspect_source("")
    nvcc = find_nvcc()
    progress(f"compiling the CUDA kernels for {arch} with {'nvcc' if nvcc else 'NVRTC'}")
    scratch.mkdir(parents=True, exist_ok=True)
    cubin, compiler = _compile_nvcc(nvcc, source, arch, scratch) if nvcc else _compile_nvrtc(source, arch)
    built = cubin_arch(cubin)
    if built is None or built.rstrip("af") != arch.rstrip("af"):
        raise ConversionFailed(f"{compiler} made no cubin for {arch} (its header says {built})", tool=compiler)
    library.export_library(str(out_path), fpack_imports=_pack_with_cubin(cubin))
    (image,) = [i for i in embedded_cuda(out_path)]
    if image.fmt != "cubin":
        raise ConversionFailed(f"{out_path.name} still carries CUDA C after embedding the cubin", tool="tvm")
    return {
        "arch": arch,
        "kernels": image.kernels,
        "compiler": compiler,
        "embedded": image.to_dict(),
        "loads_with": "the CUDA driver and libcudart (no NVRTC)",
    }


def _blob_of(path: Path) -> bytes:
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as fh:
        elf = ELFFile(fh)
        from elftools.elf.sections import SymbolTableSection

        for table in (elf.get_section_by_name(".dynsym"), elf.get_section_by_name(".symtab")):
            if not isinstance(table, SymbolTableSection):
                continue
            found = table.get_symbol_by_name(BLOB_SYMBOL)
            if not found:
                continue
            symbol = found[0]
            section = elf.get_section(symbol["st_shndx"])
            at = symbol["st_value"] - section["sh_addr"] + section["sh_offset"]
            fh.seek(at)
            size = struct.unpack("<Q", fh.read(8))[0]
            return struct.pack("<Q", size) + fh.read(size)
    raise ValueError(f"{path.name} has no {BLOB_SYMBOL}: not a TVM library with device modules")


def embedded_cuda(path: Path) -> list[CudaImage]:
    """Return the CUDA modules packed into a TVM library, read from the file (no TVM, no GPU needed)."""
    blob = _blob_of(path)
    images = []
    for key, lo, hi in _modules(blob)[1]:
        if key != "cuda":
            continue
        fmt, table, data = _cuda_payload(blob[lo:hi])
        kernels = struct.unpack_from("<Q", table, 0)[0] if len(table) >= 8 else 0
        images.append(CudaImage(fmt, len(data), cubin_arch(data) if fmt == "cubin" else None, kernels))
    return images
