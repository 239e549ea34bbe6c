"""The `kiln` command line: compile (here or on a server), inspect, routes, schema, jobs, serve.

Every command catches KilnError at one place (cli.common.handle_errors) and prints code,
message and hint; the exit status is non-zero on any failure, and no traceback reaches the
user (set KILN_DEBUG=1 to see one). The commands of other modules (service, secrets, jobs)
are registered here; those modules import cli.common, never this one.
"""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from cli import remote, secrets_commands, service_commands, tune_command, verify_command
from cli.common import console, handle_errors, out
from cli.spec_flags import spec_from_flags
from cli.summary import compile_json, event_printer, print_failures, print_summary
from cli.tool_output import tool_output_to, tool_stdout_to_stderr
from services.descriptors import registry


@click.group()
@click.version_option(package_name="kiln")
def main() -> None:
    """Kiln compiles trained models for every serving engine and verifies what it builds."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _log_events(log: Path) -> Any:
    """Return an event handler that appends each event, one JSON line, to the job's log (``-q``)."""

    def on_event(e: dict[str, Any]) -> None:
        with open(log, "a") as fh:
            fh.write(json.dumps({k: v for k, v in e.items() if k != "plan"}, default=str) + "\n")

    return on_event


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
    "--calibration",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help=".npz keyed by input name (samples on axis 0) or whole feeds keyed <sample>/<input>.",
)
@click.option(
    "--evaluation",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Labelled .npz (inputs as --calibration, plus `labels`): score the source and each artifact on it.",
)
@click.option(
    "--eval-metric",
    type=click.Choice(["top1", "topk", "top1_per_position", "mse", "mae", "iou"]),
    help="The --evaluation metric (default top1).",
)
@click.option("--eval-output", metavar="NAME", help="The output --evaluation scores (needed with several outputs).")
@click.option(
    "--max-drop",
    type=click.FloatRange(min=0),
    help="Most task accuracy an artifact may lose against the source, in the metric's units (default 0.01).",
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
@click.option(
    "--server",
    envvar="KILN_SERVER",
    metavar="URL",
    help="Compile on this Kiln service instead of here (default: KILN_SERVER); same flags, output and exit statuses.",
)
@click.option("--token", envvar="KILN_TOKEN", help="API token for --server (default: KILN_TOKEN).")
@handle_errors
def compile_cmd(
    model: Path,
    targets: tuple[str, ...],
    precision: str | None,
    repo: str | None,
    name: str | None,
    model_version: int | None,
    calibration: Path | None,
    evaluation: Path | None,
    eval_metric: str | None,
    eval_output: str | None,
    max_drop: float | None,
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
    server: str | None,
    token: str | None,
) -> None:
    """Compile MODEL for each target, check it against the source and publish it (here, or on --server)."""
    data = spec_from_flags(
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
        evaluation=evaluation,
        eval_metric=eval_metric,
        eval_output=eval_output,
        max_drop=max_drop,
    )
    if server:
        remote.compile_remote(
            server,
            token,
            model,
            data,
            repo=repo,
            cache_dir=cache_dir,
            dry_run=dry_run,
            use_cache=not no_cache,
            as_json=as_json,
            quiet=quiet,
        )
        return
    from services.pipeline import compile_model
    from services.settings import get_settings
    from services.spec import load_spec
    from services.storage import LocalArtifactStore
    from services.storage.factory import repository_from_url

    spec = load_spec(data)
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
    engines_print = tool_output_to(log) if quiet else tool_stdout_to_stderr() if as_json else nullcontext(log)
    with engines_print:
        result = compile_model(
            model,
            spec,
            store=store,
            repository=repository,
            on_event=_log_events(log) if quiet else event_printer(progress_lines=True),
            use_cache=not no_cache,
            job_id=job_id,
        )
    targets_out = {k: v.to_dict() for k, v in result.targets.items()}
    if as_json:
        out.print_json(
            json.dumps(compile_json(result.job_id, result.ok, result.plan.to_dict(), targets_out), default=str)
        )
    else:
        print_summary(result.job_id, list(targets_out.values()))
    if quiet:
        console.print(f"[dim]tool output and steps: {log}[/]", soft_wrap=True)
    if settings.cache_max_bytes:
        _enforce_cache_cap(store.root, settings.cache_max_bytes)
    if not result.ok:
        print_failures(list(targets_out.values()))


def _print_plan(model: Path, spec: Any, as_json: bool) -> None:
    """Print what ``kiln compile`` would run (the body POST /plan returns), without running it."""
    from services.formats import open_source
    from services.graph.planner import plan_routes
    from services.pipeline.local import default_model_name, local_engines

    with tempfile.TemporaryDirectory(prefix="kiln-plan-") as tmp:
        source = open_source(model, Path(tmp), spec.source_format)
    plan = plan_routes(source.format, spec, default_name=default_model_name(model), engines=local_engines())
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
    columns = ["kind", "name", "dtype", "shape"] + (["quantization"] if summary.quantization else [])
    for col in columns:
        io.add_column(col)
    for kind, tensors in (("input", summary.inputs), ("output", summary.outputs)):
        for t in tensors:
            row = [kind, t.name, t.dtype, str([d if d is not None else "?" for d in t.shape])]
            if summary.quantization:
                q = summary.quantization.get(t.name)
                row.append(f"scale {q['scale']:.6g}, zero point {q['zero_point']}" if q else "")
            io.add_row(*row)
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


for _command in (
    *service_commands.COMMANDS,
    *secrets_commands.COMMANDS,
    *tune_command.COMMANDS,
    *verify_command.COMMANDS,
    remote.jobs_group,
):
    main.add_command(_command)


if __name__ == "__main__":  # pragma: no cover
    main()
