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
import uuid
from collections.abc import Callable
from contextlib import nullcontext
from functools import wraps
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.table import Table

from cli.tool_output import tool_output_to
from services.descriptors import registry
from services.errors import KilnError

F = TypeVar("F", bound=Callable[..., Any])

# Outside a terminal rich assumes 80 columns, which folds the summary table; logs and CI
# are wider than that.
_WIDTH = None if sys.stdout.isatty() else int(os.environ.get("COLUMNS", "160"))
console = Console(stderr=True, width=_WIDTH)
out = Console(width=_WIDTH)

#: Exit statuses: 1 for a failed target, 2 for bad usage or input, 3 for internal errors.
EXIT_FAILED, EXIT_INPUT, EXIT_INTERNAL = 1, 2, 3
_INPUT_CODES = {
    "INVALID_SPEC",
    "UNSUPPORTED_FORMAT",
    "SOURCE_UNREADABLE",
    "UNSAFE_INPUT",
    "NO_ROUTE",
    "INVALID_SETTINGS",
    "SOURCE_NONFINITE",
}


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


def parse_input_flag(text: str) -> tuple[str, dict[str, Any]]:
    """Return ``(name, InputSpec fields)`` from ``NAME:SHAPE`` or ``NAME:MIN,OPT,MAX`` (shapes as 1x3x224x224)."""
    from services.errors import InvalidSpec

    name, sep, shapes = text.rpartition(":")
    hint = "Write --input NAME:1x3x224x224 (-1 keeps an axis open) or NAME:MIN,OPT,MAX, e.g. x:1x3x224x224,8x3x224x224,32x3x224x224."
    try:
        if not sep or not name:
            raise ValueError("no NAME:")
        dims = [[int(d) for d in shape.lower().split("x")] for shape in shapes.split(",")]
    except ValueError:
        raise InvalidSpec(f"--input {text!r} is not NAME:SHAPE", hint=hint) from None
    if len(dims) == 1:
        return name, {"shape": dims[0]}
    if len(dims) == 3:
        return name, {"min": dims[0], "opt": dims[1], "max": dims[2]}
    raise InvalidSpec(f"--input {text!r} gives {len(dims)} shapes; one, or three (min,opt,max)", hint=hint)


def _build_spec(
    spec_file: Path | None,
    targets: tuple[str, ...],
    precision: str | None,
    name: str | None,
    calibration: Path | None,
    version: int | None,
    no_benchmark: bool,
    inputs: tuple[str, ...] = (),
    max_batch_size: int | None = None,
    serving_root: str | None = None,
) -> Any:
    from services.spec import load_spec

    data: dict[str, Any] = json.loads(spec_file.read_text()) if spec_file else {}
    for flag in inputs:
        input_name, fields = parse_input_flag(flag)
        data.setdefault("inputs", {})[input_name] = fields
    if max_batch_size is not None:
        data["max_batch_size"] = max_batch_size
    if serving_root:
        data.setdefault("serving", {})["root"] = serving_root
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
                for alt in e["plan"].get("route_options", {}).get(target, [])[1:]:
                    console.print(f"    [dim]fallback: {alt['route']}[/]")
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
        elif kind == "route_failed":
            then = f"trying {e['next_route']}" if e["next_route"] else "no route left"
            console.print(
                f"[yellow]↪[/] {e['target']}: route {e['rank']} failed in {e.get('tool')} ({e['code']}); {then}"
            )

    return on_event


def _log_events(log: Path) -> Callable[[dict[str, Any]], None]:
    """Return an event handler that appends each event, one JSON line, to the job's log (``-q``)."""

    def on_event(e: dict[str, Any]) -> None:
        with open(log, "a") as fh:
            fh.write(json.dumps({k: v for k, v in e.items() if k != "plan"}, default=str) + "\n")

    return on_event


def _fmt_parity(parity: dict[str, Any] | None) -> str:
    if not parity or not parity.get("outputs"):
        return "-"
    outs = parity["outputs"]
    worst_abs = max(float(o["max_abs"]) for o in outs)
    worst_cos = min(float(o["cosine"]) for o in outs)
    top1 = [o["top1"] for o in outs if o.get("top1") is not None]
    snr = [float(o["snr_db"]) for o in outs if o.get("snr_db") is not None]
    text = f"{'ok' if parity.get('passed') else 'FAIL'} abs {worst_abs:.1e} cos {worst_cos:.5f}"
    text += f" snr {min(snr):.1f}dB" if snr else ""
    return text + (f" top1 {min(top1):.0%}" if top1 else "")


#: Below this width the summary leaves route and artifact out of the table and lists them
#: under it, so no cell folds mid-path.
_WIDE_SUMMARY = 120


def _summary_rows(result: Any) -> list[dict[str, str]]:
    rows = []
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
        vs = getattr(t, "vs_fp32", None)
        if vs and vs.get("rows"):
            top = vs["rows"][-1]  # the largest batch timed
            latency += f"\n{top['speedup']:.2f}x fp32 (b{top['batch_size']}): deploy {vs['deploy']}"
        where = t.published["uri"] if t.published else "-"
        rows.append(
            {"target": t.target, "status": status, "route": t.route, "parity": _fmt_parity(t.parity),
             "p50 latency": latency, "artifact": where}
        )  # fmt: skip
    return rows


def _summary_table(result: Any, width: int | None = None) -> tuple[Table, list[str]]:
    """Return the job's summary table and the lines to print under it.

    At 120 columns and more the table holds every column. Narrower, route and artifact go
    under the table, one target each, printed without folding so a path stays one string.
    """
    rows = _summary_rows(result)
    wide = (width or out.width) >= _WIDE_SUMMARY
    columns = ["target", "status", "route", "parity", "p50 latency", "artifact"]
    if not wide:
        columns = ["target", "status", "parity", "p50 latency"]
    table = Table(title=f"kiln job {result.job_id}")
    for col in columns:
        table.add_column(col, overflow="fold", no_wrap=col in ("target", "p50 latency"))
    for row in rows:
        table.add_row(*(row[c] for c in columns))
    below = [] if wide else [f"[bold]{r['target']}[/]: {r['route']} → {r['artifact']}" for r in rows]
    return table, below


def _print_summary(result: Any) -> None:
    table, below = _summary_table(result)
    out.print(table)
    for line in below:
        out.print(line, soft_wrap=True)


@main.command("compile")
@click.argument("model", type=click.Path(exists=True, path_type=Path))
@click.option("--target", "-t", "targets", multiple=True, help=", ".join(registry().targets) + " (repeatable).")
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
@click.option(
    "--input",
    "inputs",
    multiple=True,
    metavar="NAME:SHAPE",
    help="An input's shape, 1x3x224x224 (-1 = open axis), or MIN,OPT,MAX shapes (repeatable).",
)
@click.option("--max-batch-size", type=click.IntRange(min=0), help="Triton max_batch_size (0 = no batching).")
@click.option(
    "--serving-root",
    help="Path at which the servers see the repository (e.g. /models); base_path in their configs. Recorded.",
)
@click.option("--dry-run", is_flag=True, help="Print the plan (routes, steps, queues) and exit; runs nothing.")
@click.option("--no-cache", is_flag=True, help="Run every step even when its output is cached.")
@click.option("--no-benchmark", is_flag=True, help="Skip latency measurement.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
@click.option(
    "--quiet", "-q", is_flag=True, help="Only the summary; steps and the engines' own output go to the job's log."
)
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
    inputs: tuple[str, ...],
    max_batch_size: int | None,
    serving_root: str | None,
    dry_run: bool,
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

    spec = _build_spec(
        spec_file,
        targets,
        precision,
        name,
        calibration,
        model_version,
        no_benchmark,
        inputs,
        max_batch_size,
        serving_root,
    )
    if dry_run:
        _print_plan(model, spec, as_json)
        return
    settings = get_settings()
    cache = cache_dir or settings.cache_dir
    store = LocalArtifactStore(cache / "store")
    # The same factory as the service: a directory, file:// or s3:// (an unknown scheme is refused).
    repository = repository_from_url(repo or settings.repository, settings)
    repository.model_names()  # reach it now: a wrong bucket or endpoint fails before any work, not after
    job_id = uuid.uuid4().hex[:12]
    log = cache / "logs" / f"{job_id}.log"
    with tool_output_to(log) if quiet else nullcontext(log):
        result = compile_model(
            model,
            spec,
            store=store,
            repository=repository,
            on_event=_log_events(log) if quiet else _event_printer(progress_lines=True),
            use_cache=not no_cache,
            job_id=job_id,
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
        _print_summary(result)
        for t in result.targets.values():
            for warning in t.warnings:
                out.print(f"[yellow]warning[/] {t.target}: {warning}", soft_wrap=True)
    if quiet:
        console.print(f"[dim]tool output and steps: {log}[/]", soft_wrap=True)
    if settings.cache_max_bytes:
        _enforce_cache_cap(store.root, settings.cache_max_bytes)
    if not result.ok:
        for t in result.targets.values():
            if t.error:
                console.print(f"[red]{t.target}[/]: {t.error['code']}: {t.error['message'][:500]}")
                if t.error.get("hint"):
                    console.print(f"  [yellow]hint[/]: {t.error['hint']}")
        codes = {t.error["code"] for t in result.targets.values() if t.error}
        sys.exit(EXIT_INPUT if codes and codes <= _INPUT_CODES else EXIT_FAILED)


def _print_plan(model: Path, spec: Any, as_json: bool) -> None:
    """Print what ``kiln compile`` would run (the body POST /plan returns), without running it."""
    from services.formats import open_source
    from services.graph.planner import plan_routes
    from services.pipeline.local import default_model_name

    with tempfile.TemporaryDirectory(prefix="kiln-plan-") as tmp:
        source = open_source(model, Path(tmp), spec.source_format)
    plan = plan_routes(source.format, spec, default_name=default_model_name(model))
    body = plan.to_dict()
    if as_json:
        out.print_json(json.dumps({"source": source.seen, "plan": body}, default=str))
        return
    out.print(f"[bold]source[/]: {source.seen}")
    for target, route in body["routes"].items():
        out.print(f"  [cyan]{target}[/]: {route}")
    table = Table(title="steps (dry run: nothing ran)")
    for col in ("step", "engine", "queue"):
        table.add_column(col, overflow="fold")
    for step in plan.steps:
        table.add_row(step.id, step.engine, step.queue)
    out.print(table)


def _enforce_cache_cap(root: Path, max_bytes: int) -> None:
    """Prune the cache to KILN_CACHE_MAX_BYTES; when another job holds it, leave that to a later run."""
    from services.errors import ServiceUnavailable
    from services.storage.prune import prune_store

    try:
        report = prune_store(root, max_bytes=max_bytes)
    except ServiceUnavailable:
        return
    if report.removed:
        console.print(
            f"[dim]cache over its cap: removed {len(report.removed)} entries ({_human(report.freed_bytes)})[/]"
        )


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover - the loop returns


@main.group("cache")
def cache_group() -> None:
    """The local artifact cache (<cache dir>/store)."""


@cache_group.command("prune")
@click.option("--older-than", metavar="AGE", help="Remove entries unused for AGE (30m, 12h, 7d, 2w).")
@click.option(
    "--max-size", metavar="SIZE", help="Then remove least recently used entries until under SIZE (500MB, 10GiB). "
    "Default: KILN_CACHE_MAX_BYTES."
)  # fmt: skip
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), help="Default ~/.cache/kiln.")
@click.option("--wait", default=0.0, show_default=True, help="Seconds to wait for running jobs to let go of the cache.")
@click.option("--dry-run", is_flag=True, help="Say what would go; remove nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@handle_errors
def cache_prune_cmd(
    older_than: str | None, max_size: str | None, cache_dir: Path | None, wait: float, dry_run: bool, as_json: bool
) -> None:
    """Remove cache entries by age and size; waits for (never disturbs) running jobs."""
    from services.errors import InvalidSpec
    from services.settings import get_settings
    from services.storage.prune import parse_age, parse_size, prune_store

    settings = get_settings()
    age = parse_age(older_than) if older_than else None
    size = parse_size(max_size) if max_size else (settings.cache_max_bytes or None)
    if age is None and size is None:
        raise InvalidSpec("nothing to prune by", hint="Give --older-than AGE and/or --max-size SIZE.")
    report = prune_store(
        (cache_dir or settings.cache_dir) / "store", older_than=age, max_bytes=size, dry_run=dry_run, wait=wait
    )
    if as_json:
        out.print_json(json.dumps(report.to_dict()))
        return
    verb = "would remove" if dry_run else "removed"
    out.print(
        f"{verb} {len(report.removed)} entries ({_human(report.freed_bytes)}); "
        f"kept {report.kept} ({_human(report.kept_bytes)})"
    )


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
        if not registry().formats[fmt.value].is_source:
            continue  # not a source (a TensorRT plan)
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

from cli import secrets_commands, service_commands  # noqa: E402,F401  (registers api, worker, migrate, serve, token, secrets)
