"""Route planning: the cheapest converter route per target, sharing prefixes within a job.

The graph is tiny (a handful of formats, a dozen edges), so the planner enumerates every
simple path instead of running a shortest-path search: that keeps all equally cheap routes
in view, and among them it picks the one sharing the longest prefix with routes already
chosen for the job's other targets, so shared conversions run once.

Every target also gets up to ``MAX_FALLBACKS`` alternative routes, the next cheapest, as
dormant steps of the same plan (ids ``export:<target>@2``, ``publish:<target>@2``...): an
edge that fails on a real model (a converter's bug, an op it cannot map, an artifact that
fails parity) is common enough that a second route through other tools is worth keeping
ready. They run only when every route before them failed (services/pipeline/fallback.py
decides, for the in-process compile and the job store alike), so a plan costs nothing more
when its first routes work.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from services import descriptors
from services.errors import NoRoute
from services.formats import Format
from services.graph.device_checks import device_bound, gpu_engine
from services.graph.engines import queue_name
from services.graph.registry import (
    CHECK_ENTRY,
    OPTIMIZE_ENTRY,
    PUBLISH_ENTRY,
    REFERENCE_ENTRY,
    Converter,
    Exporter,
    Registry,
    default_registry,
    source_engine,
    step_entry,
)
from services.spec import CompileSpec, Precision, TargetName

__all__ = [
    "MAX_FALLBACKS",
    "Plan",
    "PlanStep",
    "Route",
    "RouteOption",
    "plan_routes",
    "published_name",
    "reachable_formats",
    "resolve_engine",
]

#: Alternative routes kept ready per target, beyond the chosen one.
MAX_FALLBACKS = 2


def resolve_engine(family: str, spec: CompileSpec | None) -> str:
    """Return the concrete engine for a family: itself, or the variant the spec's options pick ("tensorrt-cu13")."""
    desc = descriptors.registry().engines.get(family)
    if desc is None or not desc.variants:
        return family
    options = spec.options_for(family) if spec is not None else None
    variant = getattr(options, "variant", None) or desc.default_variant
    return f"{family}-{variant}"


@dataclass(frozen=True)
class Route:
    """One target's way from the source format to its exporter."""

    target: TargetName
    converters: tuple[Converter, ...]
    exporter: Exporter
    cost: float

    def describe(self, source: Format, optimize: bool = False) -> str:
        """Return a one-line route such as ``keras → onnx → optimize → openvino_ir ⇒ openvino``."""
        hops = []
        for fmt in [source, *(c.target for c in self.converters)]:
            hops.append(fmt.value)
            if optimize and fmt is Format.ONNX:
                hops.append("optimize")
        return " → ".join(hops) + f" ⇒ {self.target.value}"

    def engines(self, source: Format, spec: CompileSpec) -> set[str]:
        """Return the concrete engines whose workers run this route's steps (optimize runs on onnxruntime)."""
        formats = [source, *(c.target for c in self.converters)]
        used = {resolve_engine(c.engine, spec) for c in self.converters}
        used.add(resolve_engine(self.exporter.engine, spec))
        if spec.optimize and Format.ONNX in formats:
            used.add("onnxruntime")
        return used


@dataclass
class PlanStep:
    """One unit of work on one queue; its output is one artifact."""

    id: str
    kind: str  # reference | convert | optimize | export | check | publish
    engine: str
    entry: str  # the step's stable name (graph.registry.step_functions), or a "module:function" path
    inputs: dict[str, str] = field(default_factory=dict)  # role -> step id, or "source"
    options: dict[str, Any] = field(default_factory=dict)
    target: str | None = None
    tool: str = ""
    format_out: str | None = None
    # Ordering-only dependencies (not inputs, so not part of the cache key): steps reading
    # the source wait for the reference step, so an unreadable source fails once, up front.
    after: list[str] = field(default_factory=list)
    # Only on a fallback route: runs when the routes before it failed.
    fallback: bool = False

    @property
    def queue(self) -> str:
        return queue_name(self.engine)

    @property
    def depends_on(self) -> list[str]:
        """Return every step id this step waits for (inputs and ordering)."""
        return [d for d in self.inputs.values() if d != "source"] + [
            a for a in self.after if a not in self.inputs.values()
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "kind": self.kind,
            "engine": self.engine,
            "queue": self.queue,
            "entry": self.entry,
            "inputs": dict(self.inputs),
            "options": dict(self.options),
            "target": self.target,
            "tool": self.tool,
            "format_out": self.format_out,
            "after": list(self.after),
            "fallback": self.fallback,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PlanStep:
        return cls(
            id=d["id"],
            kind=d["kind"],
            engine=d["engine"],
            entry=d["entry"],
            inputs=dict(d.get("inputs", {})),
            options=dict(d.get("options", {})),
            target=d.get("target"),
            tool=d.get("tool", ""),
            format_out=d.get("format_out"),
            after=list(d.get("after", [])),
            fallback=bool(d.get("fallback", False)),
        )


@dataclass(frozen=True)
class RouteOption:
    """One way a target may be built: its route, cost, and the export and publish steps ending it."""

    route: str
    cost: float
    export: str  # step id
    publish: str  # step id
    tools: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "route": self.route,
            "cost": self.cost,
            "export": self.export,
            "publish": self.publish,
            "tools": list(self.tools),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RouteOption:
        return cls(d["route"], float(d["cost"]), d["export"], d["publish"], tuple(d.get("tools", ())))


@dataclass
class Plan:
    """All steps of a job in dependency order, and the route chosen per target."""

    source_format: Format
    steps: list[PlanStep]
    routes: dict[str, str]  # target -> human-readable route (the first choice)
    shared: list[str] = field(default_factory=list)  # ids of steps feeding more than one target
    # target -> its routes in the order they are tried: the chosen one, then the fallbacks.
    options: dict[str, list[RouteOption]] = field(default_factory=dict)
    #: What the job does: "compile" (POST /compile), or "tune" (POST /tune: services/tune/plan.py).
    kind: str = "compile"

    def route_options(self, target: str) -> list[RouteOption]:
        """Return the routes of ``target`` in the order they are tried (plans from before fallbacks: one)."""
        known = self.options.get(target)
        if known:
            return known
        return [RouteOption(self.routes[target], 0.0, f"export:{target}", f"publish:{target}")]

    def step(self, step_id: str) -> PlanStep:
        for s in self.steps:
            if s.id == step_id:
                return s
        raise KeyError(step_id)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source_format": self.source_format.value,
            "routes": dict(self.routes),
            "shared_steps": list(self.shared),
            "steps": [s.to_dict() for s in self.steps],
            "route_options": {t: [o.to_dict() for o in opts] for t, opts in self.options.items()},
            "kind": self.kind,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        return cls(
            source_format=Format(d["source_format"]),
            steps=[PlanStep.from_dict(s) for s in d["steps"]],
            routes=dict(d["routes"]),
            shared=list(d.get("shared_steps", [])),
            options={t: [RouteOption.from_dict(o) for o in opts] for t, opts in d.get("route_options", {}).items()},
            kind=str(d.get("kind", "compile")),
        )


def _simple_paths(reg: Registry, start: Format, goal: Format) -> list[tuple[Converter, ...]]:
    out: list[tuple[Converter, ...]] = []

    def walk(node: Format, path: tuple[Converter, ...], seen: frozenset[Format]) -> None:
        if node is goal:
            out.append(path)
            return
        for edge in reg.edges_from(node):
            if edge.target not in seen:
                walk(edge.target, (*path, edge), seen | {edge.target})

    walk(start, (), frozenset({start}))
    return out


def reachable_formats(reg: Registry, start: Format) -> list[Format]:
    """Return every format some chain of converters reaches from ``start`` (itself included)."""
    seen = {start}
    frontier = [start]
    while frontier:
        node = frontier.pop()
        for edge in reg.edges_from(node):
            if edge.target not in seen:
                seen.add(edge.target)
                frontier.append(edge.target)
    return sorted(seen, key=lambda f: f.value)


def _candidate_routes(reg: Registry, source: Format, target: TargetName, precision: Precision) -> list[Route]:
    exporter = reg.exporter(target)
    routes = []
    for fmt, export_cost in exporter.accepts.items():
        if not exporter.supports(fmt, precision):
            continue
        for path in _simple_paths(reg, source, fmt):
            cost = sum(c.cost for c in path) + export_cost
            routes.append(Route(target, path, exporter, cost))
    return routes


def _no_route(reg: Registry, source: Format, target: TargetName, precision: Precision) -> NoRoute:
    exporter = reg.exporter(target)
    reach = reachable_formats(reg, source)
    wanted = [f.value for f in exporter.accepts if exporter.supports(f, precision)]
    other_precisions = sorted(
        {p.value for f in exporter.accepts for p in Precision if f in reach and exporter.supports(f, p)}
    )
    reachable_targets = sorted(
        t.target.value for t in reg.exporters if any(f in reach and t.supports(f, precision) for f in t.accepts)
    )
    msg = (
        f"no route from {source.value} to {target.value} at {precision.value}: "
        f"{source.value} reaches {', '.join(f.value for f in reach)}; "
        f"the {target.value} exporter needs one of {', '.join(wanted) or '(none at this precision)'}"
    )
    hint = f"From {source.value} at {precision.value} Kiln can build: {', '.join(reachable_targets) or 'nothing'}."
    if other_precisions:
        hint += f" {target.value} from this source is possible at: {', '.join(other_precisions)}."
    return NoRoute(
        msg,
        hint=hint,
        source_format=source.value,
        target=target.value,
        reachable_formats=[f.value for f in reach],
        reachable_targets=reachable_targets,
    )


def _shared_prefix(a: tuple[Converter, ...], b: tuple[Converter, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x.name != y.name:
            break
        n += 1
    return n


def _choose_routes(
    reg: Registry, source: Format, spec: CompileSpec, fallbacks: int, engines: Collection[str] | None = None
) -> dict[TargetName, list[Route]]:
    """Return each target's routes in the order to try them: the chosen one, then up to ``fallbacks`` more.

    ``engines``: the engines some worker serves; only routes they can run are planned (a
    route through another engine's queue would wait there for nobody). When no route of a
    target can run, its cheapest is kept, so the job is refused naming what is missing.
    """
    chosen: dict[TargetName, Route] = {}
    others: dict[TargetName, list[Route]] = {}
    errors = []
    for target in spec.targets:
        candidates = _candidate_routes(reg, source, target, spec.precision)
        if not candidates:
            errors.append(_no_route(reg, source, target, spec.precision))
            continue
        if engines is not None:
            served = [r for r in candidates if r.engines(source, spec) <= set(engines)]
            candidates = served or [min(candidates, key=lambda r: r.cost)]
        best = min(r.cost for r in candidates)
        cheapest = [r for r in candidates if abs(r.cost - best) < 1e-9]
        # Prefer the cheapest route that shares most with what is already planned, then by name.
        cheapest.sort(
            key=lambda r: (
                -max((_shared_prefix(r.converters, c.converters) for c in chosen.values()), default=0),
                len(r.converters),
                [c.name for c in r.converters],
            )
        )
        chosen[target] = cheapest[0]
        rest = [r for r in candidates if r is not cheapest[0]]
        rest.sort(key=lambda r: (r.cost, len(r.converters), [c.name for c in r.converters]))
        others[target] = rest[:fallbacks]
    if errors:
        if len(errors) == 1:
            raise errors[0]
        raise NoRoute(
            "; ".join(e.message for e in errors),
            hint=" ".join(e.hint for e in errors),
            targets=[e.details for e in errors],
        )
    return {t: [route, *others[t]] for t, route in chosen.items()}


def published_name(base: str, target: str, n_targets: int) -> str:
    """Return the repository name of a target's model: ``base``, or ``base-<target>`` when a job has several."""
    return base if n_targets == 1 else f"{base}-{target}"


def plan_routes(
    source: Format,
    spec: CompileSpec,
    registry: Registry | None = None,
    *,
    default_name: str = "model",
    fallbacks: int = MAX_FALLBACKS,
    engines: Collection[str] | None = None,
    gpu_worker: bool = False,
) -> Plan:
    """Return the job's plan: reference, shared conversions, then export and publish per target.

    Each target's chosen route comes first; its fallback routes (``fallbacks`` at most, in
    cost order) follow as steps marked ``fallback`` unless another route already has them.
    ``engines``: plan only routes whose steps these engines run (the service's live ones).

    A target whose artifact runs on a GPU (services/graph/device_checks.py) gets a ``check:<target>``
    step on the GPU engine's queue between its export and its publish when ``gpu_worker`` (one is
    live, or in-process: this machine has one) or the spec's ``require_device_check`` says so.
    """
    device_checks = gpu_worker or spec.require_device_check
    reg = registry or default_registry()
    base_name = spec.name or default_name
    refusal = descriptors.registry().formats[source.value].not_a_source
    if refusal is not None:
        raise NoRoute(refusal[0], hint=refusal[1], source_format=source.value)
    chosen = _choose_routes(reg, source, spec, fallbacks, engines)
    steps: dict[str, PlanStep] = {}
    order: list[str] = []
    users: dict[str, set[str]] = {}

    def add(step: PlanStep) -> str:
        if step.id not in steps:
            steps[step.id] = step
            order.append(step.id)
        return step.id

    ref_id = add(
        PlanStep(
            id="reference",
            kind="reference",
            engine=resolve_engine(source_engine(source), spec),
            entry=step_entry("reference", REFERENCE_ENTRY),
            inputs={"model": "source"},
            tool=f"{source.value} runtime",
            format_out="reference",
        )
    )

    def add_route(target: TargetName, route: Route, rank: int) -> RouteOption:
        fallback = rank > 1
        prev = "source"
        chain: list[str] = []
        fmt: Format = source

        def maybe_optimize(fmt: Format, prev: str) -> str:
            if fmt is not Format.ONNX or not spec.optimize:
                return prev
            chain.append("optimize")
            return add(
                PlanStep(
                    id="/".join(chain),
                    kind="optimize",
                    engine="onnxruntime",
                    entry=step_entry("optimize", OPTIMIZE_ENTRY),
                    inputs={"model": prev},
                    after=[ref_id] if prev == "source" else [],
                    tool="kiln passes",
                    format_out=Format.ONNX.value,
                    fallback=fallback,
                )
            )

        prev = maybe_optimize(fmt, prev)
        for conv in route.converters:
            chain.append(conv.name)
            prev = add(
                PlanStep(
                    id="/".join(chain),
                    kind="convert",
                    engine=resolve_engine(conv.engine, spec),
                    entry=step_entry(f"convert:{conv.name}", conv.entry),
                    inputs={"model": prev},
                    after=[ref_id] if prev == "source" else [],
                    options={"opset": spec.opset, "signature": spec.signature},
                    tool=conv.tool,
                    format_out=conv.target.value,
                    fallback=fallback,
                )
            )
            fmt = conv.target
            prev = maybe_optimize(fmt, prev)
        if not fallback:
            for sid in chain_ids(chain):
                users.setdefault(sid, set()).add(target.value)
        exp = route.exporter
        suffix = f"@{rank}" if fallback else ""
        described = route.describe(source, spec.optimize)
        export_id = add(
            PlanStep(
                id=f"export:{target.value}{suffix}",
                kind="export",
                engine=resolve_engine(exp.engine, spec),
                entry=step_entry(f"export:{target.value}", exp.entry),
                inputs={"model": prev, "reference": ref_id},
                options={"precision": spec.precision.value},
                target=target.value,
                tool=exp.entry.rsplit(":", 1)[-1],
                format_out=(exp.artifact_format or fmt).value,
                fallback=fallback,
            )
        )
        published = export_id
        bound = device_bound(target.value, spec) if device_checks else None
        if bound is not None:
            published = add(
                PlanStep(
                    id=f"check:{target.value}{suffix}",
                    kind="check",
                    engine=gpu_engine(spec),
                    entry=step_entry("check", CHECK_ENTRY),
                    inputs={"model": export_id, "reference": ref_id},
                    options={"precision": spec.precision.value, "device_bound": bound},
                    target=target.value,
                    tool="GPU check",
                    format_out=(exp.artifact_format or fmt).value,
                    fallback=fallback,
                )
            )
        publish_id = add(
            PlanStep(
                id=f"publish:{target.value}{suffix}",
                kind="publish",
                engine=resolve_engine(exp.engine, spec),
                entry=step_entry("publish", PUBLISH_ENTRY),  # the module global, so a test may gate publish
                inputs={"model": published},
                options={"name": published_name(base_name, target.value, len(spec.targets)), "route": described},
                target=target.value,
                tool="model repository",
                fallback=fallback,
            )
        )
        tools = tuple(c.tool for c in route.converters)
        return RouteOption(described, route.cost, export_id, publish_id, tools)

    options: dict[str, list[RouteOption]] = {}
    # Every target's first choice before any fallback, so the fallbacks' steps come last
    # and a step both kinds of route use is a first-choice step.
    for target, routes in chosen.items():
        options[target.value] = [add_route(target, routes[0], 1)]
    for target, routes in chosen.items():
        options[target.value] += [add_route(target, route, rank) for rank, route in enumerate(routes[1:], start=2)]
    routes_text = {t: opts[0].route for t, opts in options.items()}
    shared = [sid for sid in order if len(users.get(sid, ())) > 1]
    return Plan(
        source_format=source, steps=[steps[i] for i in order], routes=routes_text, shared=shared, options=options
    )


def chain_ids(chain: list[str]) -> list[str]:
    """Return the step ids of every prefix of a chain of step names."""
    return ["/".join(chain[: i + 1]) for i in range(len(chain))]
