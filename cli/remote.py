"""`kiln compile --server URL` and `kiln jobs ...`: the command line against a Kiln service, through kiln_client.

One code path: every remote call goes through kiln_client (clients/python), the library
pipelines use, so the CLI and the library cannot drift apart. A remote compile prints the
same progress, summary table and ``--json`` body and exits with the same statuses as a local
one; the server publishes into its own repository.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from cli.common import EXIT_FAILED, console, handle_errors, out
from cli.summary import compile_json, event_printer, print_failures, print_summary
from services.errors import InvalidSettings, InvalidSpec

__all__ = ["compile_remote", "jobs_group", "load_client", "local_target", "tune_remote"]

#: The keys of a target in `kiln compile --json`, as a local run writes them (TargetResult).
LOCAL_TARGET_KEYS = (
    "target",
    "route",
    "status",
    "error",
    "parity",
    "benchmark",
    "vs_fp32",
    "evaluation",
    "published",
    "artifact",
    "warnings",
    "attempts",
    "device_check",
)


def load_client() -> Any:
    """Return the kiln_client module: installed, or the copy in this checkout (clients/python)."""
    try:
        import kiln_client
    except ImportError:
        checkout = Path(__file__).resolve().parents[1] / "clients" / "python"
        if not (checkout / "kiln_client" / "__init__.py").exists():
            raise InvalidSettings(
                "talking to a server needs the kiln_client package, which is not installed",
                hint="pip install kiln-client (clients/python in the Kiln repository).",
            ) from None
        sys.path.append(str(checkout))
        import kiln_client
    return kiln_client


def _connect(server: str, token: str | None) -> Any:
    if not server.startswith(("http://", "https://")):
        raise InvalidSettings(f"--server {server!r} is not an http(s) URL", hint="e.g. --server http://127.0.0.1:8000")
    return load_client().Client(server, token=token or None)


def local_target(target: Any) -> dict[str, Any]:
    """Return a remote target (kiln_client's Target) with the keys a local run's target has."""
    raw = dict(target.raw)
    raw["artifact"] = raw.get("artifact_uri")
    return {key: raw.get(key) for key in LOCAL_TARGET_KEYS} | {
        "benchmark": raw.get("benchmark") or [],
        "warnings": raw.get("warnings") or [],
        "attempts": raw.get("attempts") or [],
    }


def _local_only(repo: str | None, cache_dir: Path | None) -> None:
    given = [flag for flag, value in (("--repo", repo), ("--cache-dir", cache_dir)) if value]
    if given:
        raise InvalidSpec(
            f"{' and '.join(given)} name{'s' if len(given) == 1 else ''} a place on this machine; "
            "a server compiles into its own cache and repository",
            hint="Leave them out with --server (KILN_SERVER), or leave --server out to compile here.",
        )


def _calibration(spec: dict[str, Any]) -> Path | None:
    """Take the calibration file out of the spec: it goes up as the request's `calibration` part."""
    path = spec.pop("calibration", None)
    if path is None:
        return None
    calib = Path(str(path))
    if not calib.is_file():
        raise InvalidSpec(f"calibration {calib} is not a file", hint="--calibration takes an .npz on this machine.")
    return calib


def _evaluation(spec: dict[str, Any]) -> Path | None:
    """Return the labelled data file the spec's ``evaluation.data`` names: it goes up as the `evaluation` part."""
    section = spec.get("evaluation")
    if not isinstance(section, dict) or section.get("data") is None:
        return None
    path = section["data"]
    data = Path(str(path))
    if not data.is_file():
        raise InvalidSpec(f"evaluation data {data} is not a file", hint="--evaluation takes an .npz on this machine.")
    # The server names the stored upload; the spec keeps the file's own name, as an upload has it.
    section["data"] = data.name
    return data


def compile_remote(
    server: str,
    token: str | None,
    model: Path,
    spec: dict[str, Any],
    *,
    repo: str | None,
    cache_dir: Path | None,
    dry_run: bool,
    use_cache: bool,
    as_json: bool,
    quiet: bool,
) -> None:
    """Run `kiln compile` on ``server``: upload, follow the job's events, print the summary, exit as a local run."""
    _local_only(repo, cache_dir)
    calibration = _calibration(spec)
    evaluation = _evaluation(spec)
    with _connect(server, token) as client:
        if dry_run:
            _print_remote_plan(client, model, spec, as_json)
            return
        job = client.compile(model, spec, calibration, evaluation=evaluation, wait=False, cache=use_cache)
        printer = event_printer(progress_lines=True)
        _follow(job, None if quiet else lambda event: printer(event.data))
    targets = {name: local_target(t) for name, t in job.targets.items()}
    if as_json:
        out.print_json(json.dumps(compile_json(job.id, job.ok, job.plan, targets), default=str))
    else:
        print_summary(job.id, list(targets.values()))
    if quiet:
        console.print(f"[dim]steps and tool output: kiln jobs logs {job.id} --server {server}[/]", soft_wrap=True)
    if not job.ok:
        _fail(job, list(targets.values()))


def tune_remote(
    server: str,
    token: str | None,
    model: Path,
    tune: dict[str, Any],
    spec: dict[str, Any],
    *,
    repo: str | None,
    cache_dir: Path | None,
    use_cache: bool,
) -> Any:
    """Run `kiln tune` on ``server`` (POST /tune): upload, print the search's lines as they come; return the ended job.

    The server publishes the recommendation into its own repository (under ``spec["name"]``),
    so ``--repo`` and ``--cache-dir`` are refused as for compile.
    """
    _local_only(repo, cache_dir)
    calibration = _calibration(spec)
    evaluation = _evaluation(spec)
    with _connect(server, token) as client:
        job = client.tune(model, tune, spec, calibration, evaluation=evaluation, wait=False, cache=use_cache)
        _follow(job, _print_progress_line)
    return job


def _print_progress_line(event: Any) -> None:
    if event.type == "progress" and event.data.get("message"):
        console.print(f"  [dim]{event.data['message']}[/]", soft_wrap=True)


def _follow(job: Any, show: Callable[[Any], None] | None) -> None:
    """Show ``job``'s events as they come (``show``; None: none) and wait for its end; Ctrl-C leaves it running."""
    try:
        if show is not None:
            for event in job.follow():
                show(event)
        job.wait()
    except KeyboardInterrupt:
        console.print(
            f"[yellow]stopped following job {job.id}; it goes on on the server[/] "
            f"(kiln jobs show {job.id}, kiln jobs cancel {job.id})"
        )
        sys.exit(130)


def _fail(job: Any, targets: list[dict[str, Any]]) -> None:
    if any(t.get("error") for t in targets):
        print_failures(targets)
    error = job.error
    console.print(f"[red]job {job.id} {job.status}[/]" + (f": {error.code}: {error.message}" if error else ""))
    sys.exit(EXIT_FAILED)


def _print_remote_plan(client: Any, model: Path, spec: dict[str, Any], as_json: bool) -> None:
    """Print what the server would run for ``model`` (POST /plan), the format detected here."""
    import tempfile

    from services.formats import open_source

    override = spec.get("source_format")
    with tempfile.TemporaryDirectory(prefix="kiln-plan-") as tmp:
        source = open_source(model, Path(tmp), override)
    plan = client.plan(spec, source_format=source.format.value)
    if as_json:
        out.print_json(json.dumps({"source": source.seen, "plan": plan.raw}, default=str))
        return
    out.print(f"[bold]source[/]: {source.seen}")
    for target, route in plan.routes.items():
        out.print(f"  [cyan]{target}[/]: {route}")
    table = Table(title=f"steps on {client.url} (dry run: nothing ran)")
    for col in ("step", "engine", "queue"):
        table.add_column(col, overflow="fold")
    for step in plan.steps:
        table.add_row(step.id, step.engine, step.queue)
    out.print(table)
    if plan.engines_without_workers:
        out.print(f"[yellow]no live worker yet for[/] {', '.join(plan.engines_without_workers)}")


# --- kiln jobs -------------------------------------------------------------------------------


def _server_options(func: Any) -> Any:
    func = click.option(
        "--token", envvar="KILN_TOKEN", help="API token (default: KILN_TOKEN); needed when the server has auth on."
    )(func)
    return click.option(
        "--server", envvar="KILN_SERVER", required=True, help="The Kiln service's URL (default: KILN_SERVER)."
    )(func)


@click.group("jobs")
def jobs_group() -> None:
    """The jobs of a Kiln service (--server URL or KILN_SERVER): list, show, logs, cancel, download."""


@jobs_group.command("list")
@_server_options
@click.option("--status", type=click.Choice(["queued", "running", "succeeded", "failed", "cancelled"]))
@click.option("--name", help="Only jobs publishing this model name.")
@click.option("--target", help="Only jobs with this target.")
@click.option("--limit", default=20, show_default=True, type=click.IntRange(1, 500))
@click.option("--json", "as_json", is_flag=True, help="Print the API's JSON (JobsPublic).")
@handle_errors
def jobs_list(
    server: str, token: str | None, status: str | None, name: str | None, target: str | None, limit: int, as_json: bool
) -> None:
    """List the newest jobs."""
    with _connect(server, token) as client:
        page = client.jobs(limit=limit, status=status, name=name, target=target)
    if as_json:
        out.print_json(json.dumps({"data": [j.raw for j in page.data], "count": page.count}, default=str))
        return
    table = Table(title=f"{len(page.data)} of {page.count} jobs on {server}")
    for col in ("id", "status", "name", "targets", "created"):
        table.add_column(col, overflow="fold", no_wrap=col == "id")
    for j in page.data:
        created = j.created_at.strftime("%Y-%m-%d %H:%M:%S") if j.created_at else "-"
        table.add_row(j.id, j.status, j.name, ", ".join(j.targets), created)
    out.print(table)


@jobs_group.command("show")
@click.argument("job_id")
@_server_options
@click.option("--json", "as_json", is_flag=True, help="Print the API's JSON (JobPublic).")
@handle_errors
def jobs_show(job_id: str, server: str, token: str | None, as_json: bool) -> None:
    """Show a job: status and the same summary table as `kiln compile`."""
    with _connect(server, token) as client:
        job = client.job(job_id)
    if as_json:
        out.print_json(json.dumps(job.raw, default=str))
        return
    out.print(f"[bold]{job.name}[/] ({job.source.filename}, {job.source.format}): {job.status}")
    print_summary(job.id, [local_target(t) for t in job.targets.values()])
    if job.error is not None:
        out.print(f"[red]{job.error.code}[/]: {job.error.message}")


@jobs_group.command("logs")
@click.argument("job_id")
@_server_options
@click.option("--tail", type=click.IntRange(1, 100_000), help="Only the last N lines.")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new lines until the job ends.")
@handle_errors
def jobs_logs(job_id: str, server: str, token: str | None, tail: int | None, follow: bool) -> None:
    """Print a job's log: its events, then each step's tool output."""
    with _connect(server, token) as client:
        text = client.logs(job_id, tail=tail)
        click.echo(text, nl=False)
        if not follow:
            return
        # Events are the log's head: follow by reading again from the lines already printed.
        seen = text.count("\n") if tail is None else None
        while True:
            done = client.job(job_id).done
            if seen is None:
                seen = client.logs(job_id).count("\n")
            more = client.logs(job_id, offset=seen)
            click.echo(more, nl=False)
            seen += more.count("\n")
            if done:
                return
            time.sleep(1.0)


@jobs_group.command("cancel")
@click.argument("job_id")
@_server_options
@handle_errors
def jobs_cancel(job_id: str, server: str, token: str | None) -> None:
    """Cancel a job (a job that already ended stays as it is)."""
    with _connect(server, token) as client:
        job = client.cancel(job_id)
    out.print(f"job {job.id}: {job.status}")


@jobs_group.command("download")
@click.argument("job_id")
@_server_options
@click.option(
    "--target",
    "-t",
    "targets",
    multiple=True,
    help="Target to download (repeatable; default: every one that succeeded).",
)
@click.option("--dest", default=".", show_default=True, type=click.Path(file_okay=False, path_type=Path))
@handle_errors
def jobs_download(job_id: str, server: str, token: str | None, targets: tuple[str, ...], dest: Path) -> None:
    """Download a job's artifacts into DEST/<name>-<target>/."""
    with _connect(server, token) as client:
        job = client.job(job_id)
        wanted = list(targets) or [name for name, t in job.targets.items() if t.ok]
        if not wanted:
            raise InvalidSpec(
                f"job {job_id} ({job.status}) has no artifact to download", hint="kiln jobs show " + job_id
            )
        for target in wanted:
            out.print(str(client.download(job_id, target, dest)), soft_wrap=True)
