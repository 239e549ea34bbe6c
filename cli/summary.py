"""How `kiln compile` reports a job, local or remote: progress lines, the summary table, warnings, failures.

Everything here takes plain dicts (a target as ``TargetResult.to_dict()`` or the API's
``TargetPublic`` gives it, events as the pipeline emits them or the SSE stream carries them),
so a job run here and one run on a server print the same.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from rich.table import Table

from cli.common import console, exit_status, out

__all__ = [
    "compile_json",
    "event_printer",
    "fmt_evaluation",
    "fmt_parity",
    "print_failures",
    "print_summary",
    "print_warnings",
    "summary_table",
]

#: Below this width the summary leaves route and artifact out of the table and lists them
#: under it, so no cell folds mid-path.
WIDE_SUMMARY = 120


def event_printer(progress_lines: bool) -> Callable[[dict[str, Any]], None]:
    """Return a handler printing each job event as a progress line (stderr)."""

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


def fmt_parity(parity: Mapping[str, Any] | None) -> str:
    if not parity or not parity.get("outputs"):
        return "-"
    outs = parity["outputs"]
    worst_abs = max(float(o["max_abs"]) for o in outs)
    worst_cos = min(float(o["cosine"]) for o in outs)
    top1 = [o["top1"] for o in outs if o.get("top1") is not None]
    snr = [float(o["snr_db"]) for o in outs if o.get("snr_db") is not None]
    text = f"{'ok' if parity.get('passed') else 'FAIL'} abs {worst_abs:.1e}"
    # The worst sample's SNR says more than its cosine (a bias or a scale cannot hide in it);
    # the cosine stands in when there is no SNR (a constant source output).
    text += f" snr {min(snr):.0f}dB" if snr else f" cos {worst_cos:.5f}"
    return text + (f" top1 {min(top1):.0%}" if top1 else "")


def fmt_evaluation(evaluation: Mapping[str, Any] | None) -> str:
    """Return a target's task accuracy as the summary shows it: ``top1 0.904 (source 0.917, drop 0.013 ≤ 0.02)``."""
    if not evaluation or "passed" not in evaluation:
        return "-"
    if evaluation.get("drop") is None:  # the artifact's output was NaN or infinite
        return f"[red]{evaluation['metric']} not a number[/]"
    ok = evaluation.get("passed")
    sign = "≤" if ok else ">"
    text = (
        f"{evaluation['metric']} {evaluation['artifact']:.4f} (source {evaluation['source']:.4f}, "
        f"drop {evaluation['drop']:.4f} {sign} {evaluation['max_drop']:g})"
    )
    return text if ok else f"[red]{text}[/]"


def _summary_rows(targets: Iterable[Mapping[str, Any]]) -> list[dict[str, str]]:
    rows = []
    for t in targets:
        error = t.get("error")
        status = (
            "[green]succeeded[/]"
            if t["status"] == "succeeded"
            else f"[red]{error['code'] if error else t['status']}[/]"
        )
        warnings = t.get("warnings") or []
        if warnings:
            status += f" [yellow]({len(warnings)} warning{'s' if len(warnings) > 1 else ''})[/]"
        latency = "-"
        if t.get("benchmark"):
            b = t["benchmark"][0]
            latency = f"{b['p50_ms']:.2f} ms (b{b['batch_size']})"
        vs = t.get("vs_fp32")
        if vs and vs.get("rows"):
            top = vs["rows"][-1]  # the largest batch timed
            latency += f"\n{top['speedup']:.2f}x fp32 (b{top['batch_size']}): deploy {vs['deploy']}"
        where = t["published"]["uri"] if t.get("published") else "-"
        rows.append(
            {"target": t["target"], "status": status, "route": t["route"], "parity": fmt_parity(t.get("parity")),
             "accuracy": fmt_evaluation(t.get("evaluation")), "p50 latency": latency, "artifact": where}
        )  # fmt: skip
    return rows


def summary_table(
    job_id: str, targets: Iterable[Mapping[str, Any]], width: int | None = None
) -> tuple[Table, list[str]]:
    """Return the job's summary table and the lines to print under it.

    At 120 columns and more the table holds every column. Narrower, route and artifact go
    under the table, one target each, printed without folding so a path stays one string.
    """
    targets = list(targets)
    rows = _summary_rows(targets)
    wide = (width or out.width) >= WIDE_SUMMARY
    columns = ["target", "status", "route", "parity", "p50 latency", "artifact"]
    if not wide:
        columns = ["target", "status", "parity", "p50 latency"]
    if any(t.get("evaluation") for t in targets):  # only a job with labelled data has the column
        columns.insert(columns.index("parity") + 1, "accuracy")
    table = Table(title=f"kiln job {job_id}")
    for col in columns:
        table.add_column(col, overflow="fold", no_wrap=col in ("target", "p50 latency"))
    for row in rows:
        table.add_row(*(row[c] for c in columns))
    below = [] if wide else [f"[bold]{r['target']}[/]: {r['route']} → {r['artifact']}" for r in rows]
    return table, below


def print_summary(job_id: str, targets: Sequence[Mapping[str, Any]]) -> None:
    """Print the summary table (stdout), then each target's warnings."""
    table, below = summary_table(job_id, targets)
    out.print(table)
    for line in below:
        out.print(line, soft_wrap=True)
    print_warnings(targets)


def print_warnings(targets: Iterable[Mapping[str, Any]]) -> None:
    for t in targets:
        line = device_check_line(t.get("device_check"))
        if line:
            out.print(f"[green]GPU[/] {t['target']}: {line}", soft_wrap=True)
        for warning in t.get("warnings") or []:
            out.print(f"[yellow]warning[/] {t['target']}: {warning}", soft_wrap=True)


def device_check_line(check: Mapping[str, Any] | None) -> str | None:
    """Return the line saying which GPU checked a GPU-bound target (None: not checked on one; its warning says so)."""
    if not check or check.get("checked_on") != "gpu":
        return None
    gpu = check.get("device") or {}
    said = (
        f"checked on {gpu.get('name')} ({gpu.get('arch')}, {gpu.get('memory_mib')} MiB, driver {gpu.get('driver')}, "
        f"CUDA {gpu.get('cuda')}) with {check.get('runtime')}: parity {fmt_parity(check.get('parity'))}"
    )
    bench = check.get("benchmark") or []
    if bench:
        said += f", p50 {bench[0]['p50_ms']:.3f} ms at batch {bench[0]['batch_size']}"
    return said + f", loaded in {check.get('load_ms')} ms"


def print_failures(targets: Sequence[Mapping[str, Any]]) -> None:
    """Print each failed target's code, message and hint (stderr) and exit with the status they call for."""
    for t in targets:
        error = t.get("error")
        if error:
            console.print(f"[red]{t['target']}[/]: {error['code']}: {error['message'][:500]}")
            if error.get("hint"):
                console.print(f"  [yellow]hint[/]: {error['hint']}")
    sys.exit(exit_status(t["error"]["code"] for t in targets if t.get("error")))


def compile_json(
    job_id: str, ok: bool, plan: dict[str, Any], targets: Mapping[str, Mapping[str, Any]]
) -> dict[str, Any]:
    """Return `kiln compile --json`'s body: the same shape for a local and a remote run."""
    return {"job_id": job_id, "ok": ok, "plan": plan, "targets": {k: dict(v) for k, v in targets.items()}}
