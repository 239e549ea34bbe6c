"""The `kiln` command line: compile, inspect, routes, schema, serve.

Every command catches KilnError at one place and prints code, message and hint; the exit
status is non-zero on any failure, and no traceback reaches the user (set KILN_DEBUG=1 to
see one).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.table import Table

from services.errors import KilnError

F = TypeVar("F", bound=Callable[..., Any])

# Outside a terminal rich assumes 80 columns, which folds the summary table; logs and CI
# are wider than that.
_WIDTH = None if sys.stdout.isatty() else int(os.environ.get("COLUMNS", "160"))
console = Console(stderr=True, width=_WIDTH)
out = Console(width=_WIDTH)

#: Exit statuses: 1 for a failed target, 2 for bad usage or input, 3 for internal errors.
EXIT_FAILED, EXIT_INPUT, EXIT_INTERNAL = 1, 2, 3
_INPUT_CODES = {"INVALID_SPEC", "UNSUPPORTED_FORMAT", "SOURCE_UNREADABLE", "UNSAFE_INPUT", "NO_ROUTE"}


def _print_error(err: KilnError) -> None:
    console.print(f"[bold red]error {err.code}[/]: {err.message}")
    if err.hint:
        console.print(f"[yellow]hint[/]: {err.hint}")
    tail = err.details.get("output_tail")
    if tail and os.environ.get("KILN_DEBUG"):
        console.print(tail)


def handle_errors(func: F) -> F:
    """Turn KilnError (and anything unexpected) into a message and an exit status."""

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except KilnError as err:
            _print_error(err)
            sys.exit(EXIT_INPUT if err.code in _INPUT_CODES else EXIT_FAILED)
        except click.exceptions.Exit:
            raise
        except Exception as exc:  # the last line of defence: no traceback for users
            if os.environ.get("KILN_DEBUG"):
                raise
            console.print(f"[bold red]error INTERNAL[/]: {type(exc).__name__}: {exc}")
            console.print("[yellow]hint[/]: rerun with KILN_DEBUG=1 for a traceback and report it.")
            sys.exit(EXIT_INTERNAL)

    return wrapper  # type: ignore[return-value]


@click.group()
@click.version_option(package_name="kiln")
def main() -> None:
    """Kiln compiles trained models for every serving engine and verifies what it builds."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _build_spec(
    spec_file: Path | None,
    targets: tuple[str, ...],
    precision: str | None,
    name: str | None,
    calibration: Path | None,
    version: int | None,
    no_benchmark: bool,
) -> Any:
    from services.spec import load_spec

    data: dict[str, Any] = json.loads(spec_file.read_text()) if spec_file else {}
    if targets:
        data["targets"] = list(targets)
    if precision:
        data["precision"] = precision
    if name:
        data["name"] = name
    if version:
        data["version"] = version
    if calibration:
        data["calibration"] = str(calibration)
    if no_benchmark:
        data["benchmark"] = False
    return load_spec(data)


def _event_printer(progress_lines: bool) -> Callable[[dict[str, Any]], None]:
    def on_event(e: dict[str, Any]) -> None:
        kind = e["type"]
        if kind == "planned":
            console.print(f"[bold]source[/]: {e['source']}")
            for target, route in e["plan"]["routes"].items():
                console.print(f"  [cyan]{target}[/]: {route}")
            if e["plan"]["shared_steps"]:
                console.print(f"  shared steps: {', '.join(e['plan']['shared_steps'])}")
        elif kind == "step_started":
            console.print(f"[bold blue]▶[/] {e['step']} [dim]({e['engine']})[/]")
        elif kind == "progress" and progress_lines:
            console.print(f"    [dim]{e['message']}[/]")
        elif kind == "step_finished":
            cached = " [green](cached)[/]" if e["cached"] else ""
            console.print(f"[green]✔[/] {e['step']} in {e['seconds']:.2f}s{cached}")
        elif kind == "step_failed":
            console.print(f"[red]✘[/] {e['step']}: {e['error']['code']}: {e['error']['message'][:300]}")
        elif kind == "step_skipped":
            console.print(f"[yellow]-[/] {e['step']} skipped ({e['because']} upstream)")

    return on_event


def _fmt_parity(parity: dict[str, Any] | None) -> str:
    if not parity or not parity.get("outputs"):
        return "-"
    outs = parity["outputs"]
    worst_abs = max(float(o["max_abs"]) for o in outs)
    worst_cos = min(float(o["cosine"]) for o in outs)
    top1 = [o["top1"] for o in outs if o.get("top1") is not None]
    text = f"{'ok' if parity.get('passed') else 'FAIL'} abs {worst_abs:.1e} cos {worst_cos:.5f}"
    return text + (f" top1 {min(top1):.0%}" if top1 else "")


def _summary_table(result: Any) -> Table:
    table = Table(title=f"kiln job {result.job_id}")
    for col in ("target", "status", "route", "parity", "p50 latency", "artifact"):
        table.add_column(col, overflow="fold")
    for t in result.targets.values():
        status = (
            "[green]succeeded[/]" if t.status == "succeeded" else f"[red]{t.error['code'] if t.error else t.status}[/]"
        )
        if t.warnings:
            status += f" [yellow]({len(t.warnings)} warning{'s' if len(t.warnings) > 1 else ''})[/]"
        latency = "-"
        if t.benchmark:
            b = t.benchmark[0]
            latency = f"{b['p50_ms']:.2f} ms (b{b['batch_size']})"
        where = t.published["uri"] if t.published else "-"
        table.add_row(t.target, status, t.route, _fmt_parity(t.parity), latency, where)
    return table


@main.command("compile")
@click.argument("model", type=click.Path(exists=True, path_type=Path))
@click.option(
    "--target", "-t", "targets", multiple=True, help="onnxruntime, openvino, tflite, tfserving, tensorrt (repeatable)."
)
@click.option("--precision", "-p", type=click.Choice(["fp32", "fp16", "int8", "int4"]), help="Artifact precision.")
@click.option(
    "--repo",
    help="Model repository: a directory or s3://bucket/prefix (default KILN_REPOSITORY, else ./model-repository).",
)
@click.option("--name", help="Published model name (default: the file's name).")
@click.option("--version", "model_version", type=int, help="Published version (default: next free).")
@click.option(
    "--calibration", type=click.Path(exists=True, dir_okay=False, path_type=Path), help=".npz keyed by input name."
)
@click.option(
    "--spec",
    "spec_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="CompileSpec JSON; flags override it.",
)
@click.option(
    "--cache-dir", type=click.Path(file_okay=False, path_type=Path), help="Artifact cache (default ~/.cache/kiln)."
)
@click.option("--no-cache", is_flag=True, help="Run every step even when its output is cached.")
@click.option("--no-benchmark", is_flag=True, help="Skip latency measurement.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
@click.option("--quiet", "-q", is_flag=True, help="Only the summary.")
@handle_errors
def compile_cmd(
    model: Path,
    targets: tuple[str, ...],
    precision: str | None,
    repo: str | None,
    name: str | None,
    model_version: int | None,
    calibration: Path | None,
    spec_file: Path | None,
    cache_dir: Path | None,
    no_cache: bool,
    no_benchmark: bool,
    as_json: bool,
    quiet: bool,
) -> None:
    """Compile MODEL for each target, check it against the source and publish it."""
    from services.pipeline import compile_model
    from services.settings import get_settings
    from services.storage import LocalArtifactStore
    from services.storage.factory import repository_from_url

    spec = _build_spec(spec_file, targets, precision, name, calibration, model_version, no_benchmark)
    settings = get_settings()
    store = LocalArtifactStore((cache_dir or settings.cache_dir) / "store")
    # The same factory as the service: a directory, file:// or s3:// (an unknown scheme is refused).
    repository = repository_from_url(repo or settings.repository, settings)
    repository.model_names()  # reach it now: a wrong bucket or endpoint fails before any work, not after
    result = compile_model(
        model,
        spec,
        store=store,
        repository=repository,
        on_event=(lambda e: None) if quiet else _event_printer(progress_lines=True),
        use_cache=not no_cache,
    )
    if as_json:
        out.print_json(
            json.dumps(
                {
                    "job_id": result.job_id,
                    "ok": result.ok,
                    "plan": result.plan.to_dict(),
                    "targets": {k: v.to_dict() for k, v in result.targets.items()},
                },
                default=str,
            )
        )
    else:
        out.print(_summary_table(result))
        for t in result.targets.values():
            for warning in t.warnings:
                out.print(f"[yellow]warning[/] {t.target}: {warning}")
    if not result.ok:
        for t in result.targets.values():
            if t.error:
                console.print(f"[red]{t.target}[/]: {t.error['code']}: {t.error['message'][:500]}")
                if t.error.get("hint"):
                    console.print(f"  [yellow]hint[/]: {t.error['hint']}")
        codes = {t.error["code"] for t in result.targets.values() if t.error}
        sys.exit(EXIT_INPUT if codes and codes <= _INPUT_CODES else EXIT_FAILED)


@main.command("inspect")
@click.argument("model", type=click.Path(exists=True, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@handle_errors
def inspect_cmd(model: Path, as_json: bool) -> None:
    """Print MODEL's format, inputs and outputs, opset and operator histogram."""
    from services.inspect_model import inspect_model

    with tempfile.TemporaryDirectory(prefix="kiln-inspect-") as tmp:
        summary = inspect_model(model, Path(tmp))
    if as_json:
        out.print_json(json.dumps(summary.to_dict()))
        return
    out.print(f"[bold]format[/]: {summary.format}  [dim]({summary.seen})[/]")
    out.print(f"[bold]sha256[/]: {summary.sha256}")
    if summary.opset:
        out.print("[bold]opset[/]: " + ", ".join(f"{d} {v}" for d, v in summary.opset.items()))
    io = Table(title="inputs and outputs")
    for col in ("kind", "name", "dtype", "shape"):
        io.add_column(col)
    for kind, tensors in (("input", summary.inputs), ("output", summary.outputs)):
        for t in tensors:
            io.add_row(kind, t.name, t.dtype, str([d if d is not None else "?" for d in t.shape]))
    out.print(io)
    if summary.ops:
        hist = Table(title=f"operators ({sum(summary.ops.values())} nodes)")
        hist.add_column("op")
        hist.add_column("count", justify="right")
        for op, n in summary.ops.items():
            hist.add_row(op, str(n))
        out.print(hist)
    for note in summary.notes:
        out.print(f"[yellow]note[/]: {note}")


@main.command("routes")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@handle_errors
def routes_cmd(as_json: bool) -> None:
    """Print the converter graph: every edge, every target's exporter, and what reaches what."""
    from services.formats import Format
    from services.graph import default_registry, reachable_formats
    from services.spec import Precision

    reg = default_registry()
    if as_json:
        body = {
            "converters": [
                {
                    "name": c.name,
                    "from": c.source.value,
                    "to": c.target.value,
                    "engine": c.engine,
                    "cost": c.cost,
                    "tool": c.tool,
                }
                for c in reg.converters
            ],
            "exporters": [
                {
                    "target": e.target.value,
                    "engine": e.engine,
                    "accepts": {f.value: cost for f, cost in e.accepts.items()},
                    "precisions": {f.value: sorted(p.value for p in Precision if e.supports(f, p)) for f in e.accepts},
                }
                for e in reg.exporters
            ],
        }
        out.print_json(json.dumps(body))
        return
    edges = Table(title="converters (edges)")
    for col in ("name", "from", "to", "engine", "cost", "tool"):
        edges.add_column(col)
    for c in sorted(reg.converters, key=lambda c: (c.source.value, c.cost)):
        edges.add_row(c.name, c.source.value, c.target.value, c.engine, f"{c.cost:g}", c.tool)
    out.print(edges)
    exps = Table(title="targets (exporters)")
    for col in ("target", "engine", "accepts (cost)", "precisions"):
        exps.add_column(col)
    for e in reg.exporters:
        accepts = ", ".join(f"{f.value} ({c:g})" for f, c in e.accepts.items())
        precs = "; ".join(f"{f.value}: {'/'.join(p.value for p in Precision if e.supports(f, p))}" for f in e.accepts)
        exps.add_row(e.target.value, e.engine, accepts, precs)
    out.print(exps)
    reach = Table(title="reachable targets per source format (fp32)")
    reach.add_column("source")
    reach.add_column("targets")
    for fmt in Format:
        if fmt is Format.TENSORRT_PLAN:
            continue
        formats = set(reachable_formats(reg, fmt))
        targets = [e.target.value for e in reg.exporters if any(f in formats for f in e.accepts)]
        reach.add_row(fmt.value, ", ".join(targets) or "-")
    out.print(reach)


@main.command("schema")
@handle_errors
def schema_cmd() -> None:
    """Print the CompileSpec JSON Schema."""
    from services.spec import spec_json_schema

    out.print_json(json.dumps(spec_json_schema()))


if __name__ == "__main__":  # pragma: no cover
    main()

from cli import service_commands  # noqa: E402,F401  (registers api, worker, migrate, serve, token)
