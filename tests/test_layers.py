"""Imports between packages run one way (docs/architecture.md, DESIGN.md "Layers run one way").

An AST walk over every module under api/, cli/, services/ and workers/ collects each import,
function-level ones included, and maps both ends to a package: `api`, `cli`, `workers`, or
`services.X` (a sub-package or a top-level module of services). The checks: every package has
a layer, no package imports one in a higher layer, no two packages import each other, and no
longer loop runs through packages of one layer.

`python tests/test_layers.py` prints the edges, counts and any violations.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOP_PACKAGES = ("api", "cli", "services", "workers")

# From the ground up; a package may import only from its own layer or those below it, and two
# packages of one layer never import each other both ways. docs/architecture.md draws this.
LAYERS: tuple[tuple[str, ...], ...] = (
    # core: errors, settings, the tensor type, disk-full detection; no Kiln imports but each other
    ("services.errors", "services.public_errors", "services.settings", "services.tensors", "services.outages"),
    # engine descriptors: the one place an engine, format, target or converter edge is declared; the GPU
    # this process sees (NVML), which the GPU engine's descriptor names as its device and tool versions
    ("services.descriptors", "services.versions", "services.gpu"),
    # formats and detection, the compile spec, artifacts, ONNX I/O, the sandbox, S3 plumbing
    (
        "services.formats",
        "services.spec",
        "services.artifacts",
        "services.onnx_io",
        "services.sandbox",
        "services.s3",
    ),
    # the planner: routes from the descriptors alone
    ("services.graph",),
    # where artifacts and published versions live
    ("services.repository",),
    ("services.storage",),
    # the step machinery the roles share
    ("services.steps",),
    # the roles: runners, converters, passes, exporters and their engine helpers, validation
    (
        "services.runners",
        "services.tensorrt",
        "services.tvm",
        "services.validation",
        "services.benchmark",
        "services.inspect_model",
        "services.converters",
        "services.passes",
        "services.exporters",
    ),
    # running a plan: the executor, the reference and publish steps, the in-process compile
    ("services.pipeline",),
    # kiln tune: compiles candidates through the pipeline and times them side by side
    ("services.tune",),
    # the job store and what hangs off it
    ("services.jobs",),
    ("services.webhooks", "services.deploy_snippets"),
    # the processes
    ("workers",),
    ("api", "cli"),
)


def package_of(module: str) -> str | None:
    """Return the package a dotted module belongs to, or None when it is not Kiln's."""
    parts = module.split(".")
    if parts[0] not in TOP_PACKAGES:
        return None
    if parts[0] == "services":
        return ".".join(parts[:2]) if len(parts) > 1 else "services"
    return parts[0]


def module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(tree: ast.AST, module: str, is_package: bool) -> Iterable[str]:
    """Yield every module an AST imports, at any depth, relative imports resolved."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                if not is_package:
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            yield prefix
            # `from services import pipeline` imports the sub-package
            for alias in node.names:
                yield f"{prefix}.{alias.name}"


def import_edges(root: Path = ROOT) -> dict[tuple[str, str], set[str]]:
    """Return {(importer package, imported package): {importing modules}} for cross-package imports."""
    edges: dict[tuple[str, str], set[str]] = {}
    for top in TOP_PACKAGES:
        for path in sorted((root / top).rglob("*.py")):
            module = module_name(path, root)
            source = package_of(module)
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for imported in imported_modules(tree, module, path.name == "__init__.py"):
                target = package_of(imported)
                if target is None or target == source or source is None:
                    continue
                if target == "services":
                    continue  # `from services import x` counted through `services.x`
                if imported.count(".") == 1 and imported.startswith("services.") and not _exists(root, imported):
                    continue  # `from services import name` of something that is not a module
                edges.setdefault((source, target), set()).add(module)
    return edges


def _exists(root: Path, module: str) -> bool:
    path = root.joinpath(*module.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def layer_of(package: str) -> int | None:
    for index, layer in enumerate(LAYERS):
        if package in layer:
            return index
    return None


def violations(edges: Iterable[tuple[str, str]]) -> list[str]:
    """Return one line per broken rule: a two-way pair, an upward import, or a package with no layer."""
    edge_set = set(edges)
    problems: list[str] = []
    for a, b in sorted(edge_set):
        if a < b and (b, a) in edge_set:
            problems.append(f"two-way: {a} <-> {b}")
    for a, b in sorted(edge_set):
        la, lb = layer_of(a), layer_of(b)
        for name, layer in ((a, la), (b, lb)):
            if layer is None:
                problems.append(f"no layer declared for {name}")
        if la is not None and lb is not None and lb > la:
            problems.append(f"upward: {a} (layer {la}) imports {b} (layer {lb})")
    for group in cycles(edge_set):
        if len(group) > 2:
            problems.append("cycle among: " + ", ".join(group))
    return sorted(set(problems))


def cycles(edges: Iterable[tuple[str, str]]) -> list[list[str]]:
    """Return every set of packages that import each other round a loop (strongly connected, two or more)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def two_way_pairs(edges: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    edge_set = set(edges)
    return sorted((a, b) for a, b in edge_set if a < b and (b, a) in edge_set)


def test_every_package_has_a_layer() -> None:
    packages = {package_of(module_name(p)) for top in TOP_PACKAGES for p in (ROOT / top).rglob("*.py")}
    packages.discard("services")
    assert sorted(p for p in packages if p is not None and layer_of(p) is None) == []


def test_imports_between_packages_run_one_way() -> None:
    edges = import_edges()
    assert two_way_pairs(edges) == []
    assert cycles(edges) == []
    assert violations(edges) == []


def test_no_cli_module_imports_cli_main() -> None:
    # cli.main registers every command module; the helpers they share live in cli/common.py.
    importers = []
    for path in sorted((ROOT / "cli").rglob("*.py")):
        module = module_name(path)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if module != "cli.main" and "cli.main" in set(imported_modules(tree, module, path.name == "__init__.py")):
            importers.append(module)
    assert importers == []
    assert "cli.main" in set(imported_modules(ast.parse("def f():\n    from cli import main\n"), "cli.x", False))


def test_checker_catches_a_back_edge() -> None:
    edges = set(import_edges())
    assert ("services.exporters", "services.steps") in edges
    assert violations(edges) == []
    # an exporter's helper imported back into the step machinery: every rule fires (the roles that
    # use the steps now sit on a loop through them too)
    broken = edges | {("services.steps", "services.exporters")}
    assert violations(broken) == [
        "cycle among: services.benchmark, services.converters, services.exporters, services.passes, "
        "services.runners, services.steps, services.validation",
        "two-way: services.exporters <-> services.steps",
        "upward: services.steps (layer 6) imports services.exporters (layer 7)",
    ]
    assert two_way_pairs(broken) == [("services.exporters", "services.steps")]
    # a loop of three packages within one layer, none importing another both ways
    loop = {("services.tvm", "services.benchmark"), ("services.benchmark", "services.inspect_model")}
    loop |= {("services.inspect_model", "services.tvm")}
    assert two_way_pairs(loop) == []
    assert violations(loop) == ["cycle among: services.benchmark, services.inspect_model, services.tvm"]
    # an upward import with no edge back is still refused
    assert violations({("services.descriptors", "services.jobs")}) == [
        "upward: services.descriptors (layer 1) imports services.jobs (layer 10)"
    ]


def test_checker_sees_function_level_and_relative_imports(tmp_path: Path) -> None:
    package = tmp_path / "services" / "steps"
    package.mkdir(parents=True)
    (tmp_path / "services" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "ctx.py").write_text("def f():\n    from services.exporters import onnxruntime\n")
    (package / "memo.py").write_text("from ..runners import onnx\n")
    for name in ("exporters", "runners"):
        (tmp_path / "services" / name).mkdir()
        (tmp_path / "services" / name / "__init__.py").write_text("")
    for top in ("api", "cli", "workers"):
        (tmp_path / top).mkdir()
    assert import_edges(tmp_path) == {
        ("services.steps", "services.exporters"): {"services.steps.ctx"},
        ("services.steps", "services.runners"): {"services.steps.memo"},
    }


if __name__ == "__main__":
    found = import_edges()
    for (a, b), modules in sorted(found.items()):
        print(f"{a} -> {b}: {', '.join(sorted(modules))}")
    pairs = two_way_pairs(found)
    print(f"\ncross-package edges: {len(found)}; two-way pairs: {len(pairs)}")
    for a, b in pairs:
        print(f"  {a} <-> {b}")
    problems = violations(found)
    print(f"violations: {len(problems)}")
    for line in problems:
        print(f"  {line}")
    sys.exit(1 if problems else 0)
