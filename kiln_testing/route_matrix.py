"""The architecture matrix's verdicts: which targets it runs, which failures are known, its markdown.

benchmarks/bench_route_matrix.py builds the sources and compiles them; this module holds what
tests/test_route_matrix.py checks without compiling anything: the targets read from the
descriptor registry (a target merged later joins by itself), the named limits and diagnosed
bugs that explain a failed cell, and the report.
"""

from __future__ import annotations

import importlib.util
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.descriptors import Registry

__all__ = ["KNOWN_BUGS", "KNOWN_LIMITS", "known_bug", "known_limit", "markdown", "short_reason", "target_table"]


def target_table(reg: Registry | None = None) -> tuple[list[str], dict[str, str]]:
    """Return the registered targets this machine can run, and why each other one is left out.

    ``reg`` defaults to the process-wide registry (this package's modules and the
    ``kiln.descriptors`` entry points), so a target registered later joins the matrix by itself.
    """
    from services.descriptors import registry

    reg = reg or registry()
    runnable: list[str] = []
    excluded: dict[str, str] = {}
    for name, target in reg.targets.items():
        engine = reg.engines[target.engine]
        missing = [m for m in engine.modules if importlib.util.find_spec(m) is None]
        if engine.image.gpus:
            excluded[name] = f"needs a GPU ({engine.description}); not installable here"
        elif missing:
            excluded[name] = (
                f"engine {engine.name!r} not installed (no module {', '.join(missing)}; extra {engine.extra!r})"
            )
        else:
            runnable.append(name)
    return runnable, excluded


_ONNX2TF_LSTM = (
    "onnx2tf converts the ONNX LSTM op wrongly (max |diff| 0.28 against onnxruntime, dynamic and fixed shapes; a "
    "bare LSTM on a [1, 32, 96] input too, while the permute/reshape alone converts); Kiln's probe refuses it"
)

#: Failures understood and accepted, each with the reason: (source substring, target, code) -> why.
KNOWN_LIMITS: dict[tuple[str, str, str], str] = {
    ("LSTM", "tflite", "CONVERSION_FAILED"): _ONNX2TF_LSTM,
    ("LSTM", "tfserving", "CONVERSION_FAILED"): _ONNX2TF_LSTM,
    ("LSTM", "tvm", "CONVERSION_FAILED"): "TVM 0.27's Relax ONNX frontend has no LSTM operator",
}

#: Failures diagnosed as bugs (not fixed here), each with what goes wrong.
KNOWN_BUGS: dict[tuple[str, str, str], str] = {
    ("LSTM", "mnn", "CONVERSION_FAILED"): "MNNConvert 3.6.1 dies with SIGSEGV on an ONNX LSTM whose unused optional "
    "outputs Y_h, Y_c Kiln's optimiser dropped (DeadCode, EliminateNoOps; valid ONNX, the raw export converts)",
}


def _lookup(table: dict[tuple[str, str, str], str], source: str, target: str, code: str | None) -> str | None:
    for (needle, tgt, want), why in table.items():
        if needle.lower() in source.lower() and tgt == target and want == code:
            return why
    return None


def known_limit(source: str, target: str, code: str | None) -> str | None:
    """Return the named limit that explains this failed cell, or None."""
    return _lookup(KNOWN_LIMITS, source, target, code)


def known_bug(source: str, target: str, code: str | None) -> str | None:
    """Return the diagnosed bug behind this failed cell, or None."""
    return _lookup(KNOWN_BUGS, source, target, code)


#: The head of a one-route failure ("every route to mnn failed: (1) onnx ⇒ mnn: CODE in step (tool): "),
#: which the cell's code and route already say: the short reason starts after it.
_ROUTE_HEAD = re.compile(r"^every route to \S+ failed: \(1\) .*?: [A-Z_]+ in \S+ \([^)]*\): ")
#: A later attempt's head ("; (2) route: CODE in step (tool): "), kept as "; (2) ".
_NEXT_HEAD = re.compile(r"; \((\d+)\) [^;]*?: [A-Z_]+ in \S+ \([^)]*\): ")


def short_reason(message: str, limit: int = 200) -> str:
    """Return the first line of an error message without its route head, cut to ``limit`` characters."""
    line = next((ln.strip() for ln in message.splitlines() if ln.strip()), "")
    line = _NEXT_HEAD.sub(r"; (\1) ", _ROUTE_HEAD.sub("", line))
    return line if len(line) <= limit else line[: limit - 1] + "…"


def markdown(rows: list[dict[str, Any]], targets: list[str], excluded: dict[str, str]) -> str:
    """Return the matrix as a markdown table, the pass rates, then every failed cell named with its error."""
    lines = ["| source | " + " | ".join(targets) + " | job s |", "|---|" + "---|" * (len(targets) + 1)]
    passed = dict.fromkeys(targets, 0)
    total = dict.fromkeys(targets, 0)
    first = 0
    failures: list[str] = []
    for row in rows:
        cells = []
        for target in targets:
            cell = row["cells"].get(target)
            total[target] += 1
            if cell is None:
                cells.append("**not built**")
                failures.append(f"- {row['source']} → {target}: unexplained: {row.get('error')}")
            elif cell["status"] == "succeeded":
                passed[target] += 1
                first += cell["rank"] == 1
                via = "" if cell["rank"] == 1 else f" (route {cell['rank']})"
                cells.append(f"ok{via}")
            else:
                limit = known_limit(row["source"], target, cell.get("code"))
                bug = known_bug(row["source"], target, cell.get("code"))
                if limit:
                    kind, mark = f"named limit: {limit}", " (limit)"
                elif bug:
                    kind, mark = f"bug: {bug}", " **(bug)**"
                else:
                    kind, mark = "unexplained (a bug until named)", " **(unexplained)**"
                cells.append(f"`{cell.get('code')}`{mark}")
                failures.append(f"- {row['source']} → {target}: `{cell.get('code')}` {cell.get('message')} — {kind}")
        lines.append(f"| {row['source']} | " + " | ".join(cells) + f" | {row.get('seconds', '-')} |")
    rates = [f"{passed[t]}/{total[t]}" for t in targets]
    lines.append("| **pass rate** | " + " | ".join(rates) + " | |")
    all_passed, all_total = sum(passed.values()), sum(total.values())
    pct = 100.0 * all_passed / all_total if all_total else 0.0
    lines.append("")
    lines.append(
        f"Passed {all_passed} of {all_total} cells ({pct:.1f} %; {first} on the first-choice route, "
        f"{all_passed - first} by a fallback)."
    )
    if excluded:
        lines += ["", "Targets left out:", *(f"- {t}: {why}" for t, why in excluded.items())]
    if failures:
        lines += ["", "Failed cells:", *failures]
    return "\n".join(lines)
