"""Paddle inference models (PIR ``.json`` or ProgramDesc ``.pdmodel``) to ONNX with paddle2onnx.

paddle2onnx names every graph output ``fetch_name_<i>``, while Paddle's predictor (the
reference) names a ``.pdmodel``'s outputs after their variables (``linear_0.tmp_1``); the
ONNX inputs and outputs are renamed to the predictor's names so parity pairs them by name
and a serving client reads the names the Paddle model had.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import traceback
from typing import Any

from services.artifacts import Artifact
from services.errors import ConversionFailed, KilnError
from services.formats import Format
from services.steps.context import StepContext

__all__ = ["DEFAULT_OPSET", "paddle_to_onnx", "rename_io"]

DEFAULT_OPSET = 17
MODEL_FILE = "model.onnx"
TOOL = "paddle2onnx"


def rename_io(model: Any, inputs: list[str], outputs: list[str]) -> dict[str, str]:
    """Rename the graph's inputs and outputs, by position, to ``inputs``/``outputs``; return the renames."""
    graph = model.graph
    renames: dict[str, str] = {}
    for values, names in ((graph.input, inputs), (graph.output, outputs)):
        if len(values) != len(names):
            raise ValueError(f"the ONNX graph has {len(values)} values where Paddle has {names}")
        for value, name in zip(values, names, strict=True):
            if value.name != name:
                renames[value.name] = name
    if not renames:
        return renames
    taken = {v.name for v in graph.value_info} | {n for node in graph.node for n in (*node.input, *node.output)}
    clash = {new for old, new in renames.items() if new in taken and new not in renames}
    if clash:
        raise ValueError(f"cannot rename to {sorted(clash)}: the graph already uses those names")
    for value in (*graph.input, *graph.output, *graph.value_info):
        value.name = renames.get(value.name, value.name)
    for node in graph.node:
        node.input[:] = [renames.get(n, n) for n in node.input]
        node.output[:] = [renames.get(n, n) for n in node.output]
    return renames


def paddle_to_onnx(ctx: StepContext) -> Artifact:
    """Convert the Paddle inference model to model.onnx (fp32) with paddle2onnx."""
    import onnx

    from services.runners.paddle import PaddleRunner, import_paddle

    import_paddle()  # paddle2onnx imports Paddle; its import-time notices stay out of the log
    import paddle2onnx

    runner = PaddleRunner(ctx.model.path)  # vets, stages a private copy, and knows Paddle's I/O names
    opset = ctx.opset(DEFAULT_OPSET)
    dst = ctx.out_dir / MODEL_FILE
    ctx.progress(f"converting the Paddle {runner.model.program.suffix} program to ONNX opset {opset} with {TOOL}")
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log), _env(P2O_KEEP_TEMP_MODEL="0"):
            paddle2onnx.export(
                str(runner.model.program),
                str(runner.model.params),
                save_file=str(dst),
                opset_version=opset,
                auto_upgrade_opset=True,
                enable_onnx_checker=True,
                enable_optimize=True,
            )
        model = onnx.load(str(dst))
        renames = rename_io(model, [t.name for t in runner.inputs], [t.name for t in runner.outputs])
        if renames:
            onnx.save(model, str(dst))
    except KilnError:
        raise
    except (Exception, SystemExit) as exc:  # paddle2onnx raises Exception, asserts, or exits on unknown ops
        raise ConversionFailed(
            f"{TOOL} could not convert {runner.model.program.name}: {_reason(exc, log.getvalue())[:500]}",
            hint="paddle2onnx may lack a rule for an operator (its output names it); for a .pdmodel program "
            "the openvino target reads it directly.",
            step=ctx.step.id,
            tool=TOOL,
            output_tail=_ANSI.sub("", log.getvalue() + "".join(traceback.format_exception(exc)))[-2000:],
        ) from exc
    finally:
        runner.close()
    return Artifact(
        root=ctx.out_dir,
        kind=Format.ONNX.value,
        entry=MODEL_FILE,
        meta={
            "exporter": f"paddle2onnx {paddle2onnx.__version__}",
            "source_program": runner.model.program.suffix,
            "opset": next((int(o.version) for o in model.opset_import if o.domain in ("", "ai.onnx")), opset),
            "renamed": renames,
            "paddle_ops": runner.model.ops,
            "io": {"inputs": [t.to_dict() for t in runner.inputs], "outputs": [t.to_dict() for t in runner.outputs]},
        },
    )


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _reason(exc: BaseException, printed: str) -> str:
    """What paddle2onnx's failure was, rather than ``SystemExit: -1``.

    On a converter error paddle2onnx prints "[ERROR] Failed to convert ...: <the C++ error>"
    to stdout and calls ``sys.exit(-1)`` while handling it; the C++ error is the exit's
    ``__context__`` and also the printed line (measured on a real PP-OCRv4 detector:
    "(Unimplemented) the 0th elementwise MUST be ir::FloatAttribute ... pir_parser.cc:814").
    """
    if isinstance(exc, SystemExit):
        cause = exc.__context__
        if cause is not None and str(cause).strip():
            return f"{type(cause).__name__}: {_first_lines(str(cause))} (paddle2onnx then exited with {exc.code})"
        errors = [line for line in _ANSI.sub("", printed).splitlines() if "[ERROR]" in line]
        if errors:
            return f"{_first_lines(errors[0].split('[ERROR]', 1)[1])} (paddle2onnx then exited with {exc.code})"
    return f"{type(exc).__name__}: {exc}"


def _first_lines(text: str, n: int = 2) -> str:
    return " ".join(line.strip() for line in text.strip().splitlines()[:n])


@contextlib.contextmanager
def _env(**values: str) -> Any:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
