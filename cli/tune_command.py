"""`kiln tune MODEL`: search engines × precisions × settings for the artifact that best meets the goals.

The search lives in services/tune; this module parses the flags, prints progress on stderr,
and the candidates table, the recommendation and (``--profile``) the per-layer profiles.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from cli.common import EXIT_FAILED, console, handle_errors, out
from cli.spec_flags import evaluation_flags, parse_input_flag

__all__ = ["COMMANDS", "tune_cmd"]


def _csv(text: str | None) -> list[str]:
    return [p.strip() for p in (text or "").split(",") if p.strip()]


def _batches(text: str, flag: str = "--batch") -> list[int]:
    from services.errors import InvalidSpec

    try:
        values = [int(p) for p in _csv(text)]
    except ValueError:
        raise InvalidSpec(f"{flag} {text!r} is not a list of sizes", hint=f"e.g. {flag} 1 or {flag} 1,8,32") from None
    if not values or min(values) < 1:
        raise InvalidSpec(f"{flag} {text!r} needs sizes of 1 or more", hint=f"e.g. {flag} 1,8")
    return values


def _progress(e: dict[str, Any]) -> None:
    kind = e.get("type")
    if kind == "tune_build":
        console.print(f"[bold]building[/] {e['precision']}: {', '.join(e['targets'])}")
    elif kind == "step_finished":
        console.print(f"  [dim]✔ {e['step']}{' (cached)' if e.get('cached') else ''}[/]")
    elif kind == "step_failed":
        console.print(f"  [red]✘ {e['step']}[/]: {e['error'].get('code')}")
    elif kind == "tune_measure":
        console.print(f"[bold]timing[/] {e['candidates']} candidates side by side")
    elif kind == "tune_concurrency":
        levels = ",".join(map(str, e["levels"]))
        console.print(f"[bold]throughput[/] of {e['candidate']} at {levels} concurrent instances per batch size")


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _settings(s: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in s.items()) or "-"


def _accuracy(evaluation: dict[str, Any] | None) -> str:
    if not evaluation or evaluation.get("artifact") is None:
        return "-"
    return f"{evaluation['metric']} {evaluation['artifact']:.4f} (drop {evaluation['drop']:.4f})"


def _print_report(body: dict[str, Any], show_profile: bool) -> None:
    rec = body["recommendation"]
    table = Table(title=f"candidates ({body['objective']}, batch {','.join(map(str, body['batches']))})")
    for col in (
        "target",
        "precision",
        "settings",
        "batch",
        "status",
        "p50 ms",
        "IQR ms",
        "p99 ms",
        "samples/s",
        "note",
    ):
        table.add_column(col, overflow="fold")
    floor = any(c.get("evaluation") for c in body["candidates"])
    if floor:
        table.add_column("accuracy", overflow="fold")
    for c in body["candidates"]:
        chosen = rec is not None and c["id"] == rec["id"]
        note = "★ recommended" if chosen else (c["reason"] or "; ".join(c["violations"]) or "")
        table.add_row(
            c["target"],
            c["precision"],
            _settings(c["settings"]),
            str(c["batch"]),
            c["status"],
            _ms(c["p50_ms"]),
            _ms(c["iqr_ms"]),
            _ms(c["p99_ms"]),
            "-" if c["throughput"] is None else f"{c['throughput']:.0f}",
            note[:80],
            *([_accuracy(c.get("evaluation"))] if floor else []),
        )
    out.print(table)
    seen = set()
    for c in body["candidates"]:
        for w in c["warnings"]:
            if (c["target"], c["precision"], w) not in seen:
                seen.add((c["target"], c["precision"], w))
                out.print(f"[yellow]warning[/] {c['target']} {c['precision']}: {w}", soft_wrap=True)
    cache = body["cache"]
    m = body["measurement"]
    out.print(
        f"[bold]search[/]: {body['wall_s']:.1f}s; cache: {cache['steps_cached']} of {cache['steps']} steps reused "
        f"({cache['conversions_reused']} conversions); timing: {m.get('rounds', 0)} interleaved rounds"
        + ("" if m.get("alone") in (True, None) else " [yellow](host busy: not alone)[/]")
    )
    if body["stopped_early"]:
        out.print(f"[yellow]stopped early[/]: {body['stopped_early']}")
    if rec is None:
        return
    out.print(
        f"[bold green]recommendation[/]: {rec['target']} {rec['precision']} {_settings(rec['settings'])} "
        f"(batch {rec['batch']}): p50 {_ms(rec['p50_ms'])} ms [95% CI {_ms(rec['p50_ci_ms'][0])}–"
        f"{_ms(rec['p50_ci_ms'][1])}], p99 {_ms(rec['p99_ms'])} ms"
    )
    out.print(f"  {rec['verdict']}", soft_wrap=True)
    _print_serving(rec.get("serving"))
    if body.get("published"):
        pub = body["published"]
        out.print(f"[bold]published[/]: {pub.get('name', '')} version {pub.get('version', '')} {pub.get('uri', '')}")
    if show_profile:
        for role, prof in body["profiles"].items():
            if not prof.get("available"):
                out.print(f"[dim]profile of {role} ({prof['candidate']}): {prof.get('reason')}[/]")
                continue
            t = Table(title=f"profile: {role} — {prof['candidate']} ({prof['total_ms_per_run']:.3f} ms/run in ops)")
            for col in ("op type", "ms/run", "share", "nodes"):
                t.add_column(col)
            for op in prof["top_ops"]:
                t.add_row(op["op_type"], f"{op['ms_per_run']:.4f}", f"{op['share']:.1%}", str(op["nodes"]))
            out.print(t)
            if "time_by_exec_precision" in prof:
                shares = ", ".join(f"{k} {v:.0%}" for k, v in prof["time_by_exec_precision"].items())
                out.print(f"  executed in: {shares}")


def _print_serving(serving: dict[str, Any] | None) -> None:
    """Print the throughput-vs-concurrency curve (samples/s per batch × instances, the pick starred) and the pick."""
    if not serving:
        return
    curve = serving.get("curve")
    if curve:
        t = Table(
            title=f"throughput vs concurrency: {curve['candidate']} (samples/s, median of {curve['rounds']} rounds)"
        )
        t.add_column("batch")
        for n in curve["concurrency"]:
            t.add_column(f"{n} inst.", justify="right")
        pick = curve["pick"] or {}
        for b in curve["batches"]:
            row = [str(b)]
            for n in curve["concurrency"]:
                p = next(p for p in curve["points"] if p["batch"] == b and p["instances"] == n)
                if p["throughput"] is None:
                    row.append("-")
                    continue
                star = " ★" if (b, n) == (pick.get("batch"), pick.get("instances")) else ""
                row.append(f"{p['throughput']:.0f}{star}")
            t.add_row(*row)
        out.print(t)
        if curve["pick_vs_best"] is not None:
            out.print(
                f"  pick/best measured = {curve['pick_vs_best']:.3f}; "
                f"{len(curve['tied_within_noise'])} other point(s) within the noise of the pick"
            )
    triton = " ".join(f"{k}={v}" for k, v in serving["triton"].items())
    out.print(
        f"[bold]serving[/]: batch {serving['batch']} × {serving['instances']} instance(s) "
        f"({serving['basis']}); Triton: {triton}",
        soft_wrap=True,
    )


@click.command("tune")
@click.argument("model", type=click.Path(exists=True, path_type=Path))
@click.option("--objective", type=click.Choice(["latency", "throughput", "size"]), default="latency", show_default=True)
@click.option("--batch", "batch", default="1", show_default=True, help="Batch size, or a list: 1,8,32.")
@click.option("--max-p99-ms", type=float, help="Only candidates whose p99 latency is at most this qualify.")
@click.option("--targets", help="Comma-separated targets (default: the CPU targets installed here).")
@click.option("--precisions", default="fp32,fp16,int8", show_default=True, help="Comma-separated precisions.")
@click.option("--repo", help="Publish the recommendation to this model repository (as `kiln compile --repo`).")
@click.option("--name", help="Published model name (default: the file's name).")
@click.option("--budget", help="Time budget for the search, e.g. 90s, 10m; the search stops early and says so.")
@click.option("--rounds", type=click.IntRange(min=1, max=100_000), default=50, show_default=True)
@click.option(
    "--concurrency",
    default="1,2,4,8",
    show_default=True,
    help="Throughput objective: concurrent instances to measure the recommendation at, per batch size.",
)
@click.option("--warmup", type=click.IntRange(min=0, max=10_000), default=5, show_default=True)
@click.option("--profile", "show_profile", is_flag=True, help="Print the per-layer profiles (always in --json).")
@click.option("--spec", "spec_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="CompileSpec JSON (inputs, tolerances...).")  # fmt: skip
@click.option("--input", "inputs", multiple=True, metavar="NAME:SHAPE", help="An input's shape (repeatable).")
@click.option("--calibration", type=click.Path(exists=True, dir_okay=False, path_type=Path), help=".npz for int8.")
@click.option(
    "--evaluation",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Labelled .npz (inputs + `labels`): an accuracy floor; a candidate losing more than --max-drop is out.",
)
@click.option(
    "--eval-metric",
    type=click.Choice(["top1", "topk", "top1_per_position", "mse", "mae", "iou"]),
    help="The --evaluation metric (default top1).",
)
@click.option("--eval-output", metavar="NAME", help="The output --evaluation scores (needed with several outputs).")
@click.option("--max-drop", type=click.FloatRange(min=0), help="Most accuracy a candidate may lose (default 0.01).")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), help="Artifact cache (default ~/.cache/kiln).")  # fmt: skip
@click.option("--no-cache", is_flag=True, help="Run every step even when its output is cached.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
@click.option(
    "--server",
    envvar="KILN_SERVER",
    metavar="URL",
    help="Tune on this Kiln service (POST /tune) instead of here (default: KILN_SERVER); it publishes the "
    "recommendation into its own repository.",
)
@click.option("--token", envvar="KILN_TOKEN", help="API token for --server (default: KILN_TOKEN).")
@handle_errors
def tune_cmd(
    model: Path,
    objective: str,
    batch: str,
    max_p99_ms: float | None,
    targets: str | None,
    precisions: str,
    repo: str | None,
    name: str | None,
    budget: str | None,
    rounds: int,
    concurrency: str,
    warmup: int,
    show_profile: bool,
    spec_file: Path | None,
    inputs: tuple[str, ...],
    calibration: Path | None,
    evaluation: Path | None,
    eval_metric: str | None,
    eval_output: str | None,
    max_drop: float | None,
    cache_dir: Path | None,
    no_cache: bool,
    as_json: bool,
    server: str | None,
    token: str | None,
) -> None:
    """Find the target, precision and engine settings that best meet the goals for MODEL, measured side by side."""
    from services.errors import InvalidSpec
    from services.settings import get_settings
    from services.storage import LocalArtifactStore
    from services.storage.factory import repository_from_url
    from services.tune import TuneRequest, parse_budget, tune_model

    spec_data: dict[str, Any] = {}
    if spec_file:
        try:
            spec_data = json.loads(spec_file.read_text())
        except json.JSONDecodeError as exc:
            raise InvalidSpec(f"{spec_file} is not JSON: {exc}") from None
        if not isinstance(spec_data, dict):
            raise InvalidSpec(f"{spec_file} holds no JSON object")
        for key in ("targets", "precision", "benchmark", "name"):
            spec_data.pop(key, None)  # the search sets these itself
    for flag in inputs:
        input_name, fields = parse_input_flag(flag)
        spec_data.setdefault("inputs", {})[input_name] = fields
    if calibration:
        spec_data["calibration"] = str(calibration)
    evaluation_flags(spec_data, evaluation, eval_metric, eval_output, max_drop)
    req = TuneRequest(
        model=model,
        objective=objective,
        batches=_batches(batch),
        max_p99_ms=max_p99_ms,
        targets=_csv(targets) or None,
        precisions=_csv(precisions),
        budget_s=parse_budget(budget) if budget else None,
        spec_data=spec_data,
        rounds=rounds,
        warmup=warmup,
        concurrency=_batches(concurrency, "--concurrency"),
        name=name,
        use_cache=not no_cache,
    )
    if server:
        body = _tune_on(server, token, req, spec_data, repo=repo, cache_dir=cache_dir)
        _report(body, as_json, show_profile)
        return
    settings = get_settings()
    store = LocalArtifactStore((cache_dir or settings.cache_dir) / "store")
    repository = None
    if repo:
        repository = repository_from_url(repo, settings)
        repository.model_names()  # reach it now: a wrong location fails before the search
    report = tune_model(req, store=store, repository=repository, on_event=_progress)
    _report(report.to_dict(), as_json, show_profile)


def _report(body: dict[str, Any], as_json: bool, show_profile: bool) -> None:
    """Print the tune's report (a local one or a server's) and exit 1 when nothing qualified."""
    if as_json:
        out.print_json(json.dumps(body, default=str))
    else:
        _print_report(body, show_profile)
    if body["recommendation"] is None:
        console.print(f"[bold red]error NO_CANDIDATE[/]: {'; '.join(body['notes']) or 'nothing qualified'}")
        console.print("[yellow]hint[/]: loosen --max-p99-ms, add targets or precisions, or give a larger --budget.")
        raise SystemExit(EXIT_FAILED)


def _tune_on(
    server: str, token: str | None, req: Any, spec_data: dict[str, Any], *, repo: str | None, cache_dir: Path | None
) -> dict[str, Any]:
    """Run the search ``req`` describes on ``server``; return its report, with where it published."""
    from cli.remote import tune_remote
    from services.errors import KilnError

    goals = {
        "objective": req.objective,
        "batch": req.batches,
        "max_p99_ms": req.max_p99_ms,
        "targets": req.targets,
        "precisions": req.precisions,
        "budget_s": req.budget_s,
        "rounds": req.rounds,
        "warmup": req.warmup,
        "concurrency": req.concurrency,
    }
    spec = {**spec_data, **({"name": req.name} if req.name else {})}
    job = tune_remote(
        server,
        token,
        req.model,
        {k: v for k, v in goals.items() if v is not None},
        spec,
        repo=repo,
        cache_dir=cache_dir,
        use_cache=req.use_cache,
    )
    if job.tune is None:  # refused or failed before its search reported (the source, the sandbox...)
        error = job.error or next((t.error for t in job.targets.values() if t.error), None)
        raise KilnError(
            f"the tune job {job.id} ended {job.status} without a report"
            + (f": {error.code}: {error.message}" if error else ""),
            hint=f"kiln jobs logs {job.id} --server {server}",
        )
    body: dict[str, Any] = dict(job.tune)
    target = job.targets.get("tune")
    body["published"] = target.published if target is not None else None
    body["job_id"] = job.id
    return body


COMMANDS = (tune_cmd,)
