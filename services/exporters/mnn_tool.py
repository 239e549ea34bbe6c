"""MNN's converter and quantiser, run as a separate Python process with network and process spawning refused.

Run as ``python -I mnn_tool.py REQUEST.json``; it imports nothing from Kiln, so ``-I`` (no
environment variables, no script directory on ``sys.path``) is safe. Why a process of its own:

- The ``mnn`` wheel's Python wrappers (``MNN.tools``: ``mnnconvert``, ``mnnquant``) import
  ``MNN.tools.utils.log`` on import, which runs ``pip install -U aliyun-log-python-sdk`` when
  that SDK is missing and then reports every conversion, with the machine id, to a remote
  log service. Kiln never imports ``MNN.tools``: it calls the compiled converter, the
  ``_tools`` extension module those wrappers wrap (``_tools.mnnconvert(argv)`` is MNNConvert's
  ``main``, ``_tools.mnnquant(argv)`` the offline quantiser's). An import hook here refuses
  ``MNN.tools`` and ``aliyun`` outright, and an audit hook refuses every socket connection,
  name lookup and process start (``os.system``, ``subprocess``, ``exec``, ``spawn``), so even a
  future wheel that phoned home from elsewhere in Python would fail loudly instead.
- The quantiser aborts the whole process (``std::terminate``) on graphs it cannot quantise
  (e.g. "Don't support quantizing UnaryOP ... to Int8" for an exact-erf GELU): a crash here
  is an exit code for the exporter to handle, not a dead worker.
- The converter and quantiser print to the C++ stdout; the exporter keeps that as the tool log.

The request is a JSON object: ``{"op": "convert" | "quantize" | "summary", "result": path, ...}``;
the result (also JSON) says what was done and lists every refused event under ``denied``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

#: Audit events that reach the network or start another program. Refused, and recorded.
DENIED_EVENTS = (
    "socket.connect",
    "socket.getaddrinfo",
    "socket.gethostbyname",
    "socket.gethostbyaddr",
    "socket.sendto",
    "socket.sendmsg",
    "urllib.Request",
    "http.client.connect",
    "subprocess.Popen",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.startfile",
    "pty.spawn",
)
#: Modules the tool must never import: the wheel's phoning-home wrappers, the SDK they install, pip.
DENIED_MODULES = ("MNN.tools", "aliyun", "pip")

_denied: list[str] = []


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event in DENIED_EVENTS:
        _denied.append(f"{event} {args!r}"[:300])
        raise PermissionError(f"kiln's MNN tool refuses {event}: no network and no other programs here")


class _RefuseModules:
    """A meta path finder that refuses the modules in DENIED_MODULES (and their submodules)."""

    @staticmethod
    def find_spec(name: str, path: Any = None, target: Any = None) -> None:
        if any(name == m or name.startswith(m + ".") for m in DENIED_MODULES):
            _denied.append(f"import {name}")
            raise ImportError(f"kiln's MNN tool refuses to import {name}")
        return None


def install_guard() -> None:
    """Refuse network access, process starts and the denied modules for the rest of this process."""
    sys.meta_path.insert(0, _RefuseModules())  # type: ignore[arg-type]
    sys.addaudithook(_audit)


def _tools() -> Any:
    import _tools  # the mnn wheel's compiled converter/quantiser (top-level extension module)

    return _tools


def convert(argv: list[str]) -> dict[str, Any]:
    """Run MNNConvert with ``argv`` (its command line, without the program name)."""
    ok = _tools().mnnconvert(["MNNConvert", *argv])
    return {"ok": bool(ok)}


def quantize(src: str, dst: str, config: str) -> dict[str, Any]:
    """Run MNN's offline quantiser: ``src`` (a float .mnn) to ``dst`` by the calibration ``config``."""
    # The argv form: the wheel's own mnnquant.py passes three strings and crashes the extension.
    ok = _tools().mnnquant(["mnnquant", src, dst, config])
    return {"ok": bool(ok) and Path(dst).is_file()}


def _is_conv(op: dict[str, Any]) -> bool:
    return op.get("main_type") == "Convolution2D" and isinstance(op.get("main"), dict)


def summary(model: str, scratch: str) -> dict[str, Any]:
    """Return what a .mnn holds: op counts and how its convolution/matmul weights are stored."""
    dump = Path(scratch) / "model.json"
    ok = _tools().mnnconvert(["MNNConvert", "-f", "MNN", "--modelFile", model, "--JsonFile", str(dump)])
    if not ok or not dump.is_file():
        return {"ok": False}
    net = json.loads(dump.read_text())
    dump.unlink()
    ops: dict[str, int] = {}
    weights = {"float32": 0, "float16": 0, "int8": 0}
    activations_int8 = 0
    for op in net.get("oplists", []):
        ops[op.get("type", "?")] = ops.get(op.get("type", "?"), 0) + 1
        if not _is_conv(op):
            continue
        quant = op["main"].get("quanParameter")
        if not quant:
            weights["float32"] += 1
        elif quant.get("type") == 3:  # IDST type 3: weights stored as half floats
            weights["float16"] += 1
        else:
            weights["int8"] += 1
            if quant.get("scaleIn") and quant.get("scaleOut"):  # activation scales: a full-int8 kernel
                activations_int8 += 1
    return {
        "ok": True,
        "ops": dict(sorted(ops.items())),
        "conv_weights": weights,
        "int8_activation_convs": activations_int8,
        "version": (net.get("extraInfo") or {}).get("version"),
    }


def main(argv: list[str]) -> int:
    install_guard()
    request = json.loads(Path(argv[1]).read_text())
    op = request["op"]
    if op == "convert":
        result = convert(request["argv"])
    elif op == "quantize":
        result = quantize(request["src"], request["dst"], request["config"])
    elif op == "summary":
        result = summary(request["model"], request["scratch"])
    else:
        raise SystemExit(f"unknown op {op!r}")
    sys.stdout.flush()
    loaded = sorted(m for m in sys.modules if any(m == d or m.startswith(d + ".") for d in DENIED_MODULES))
    result.update(denied=list(_denied), denied_modules_loaded=loaded)
    Path(request["result"]).write_text(json.dumps(result))
    return 0 if result.get("ok") and not _denied else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv))
