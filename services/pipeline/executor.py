"""Run one plan step: resolve inputs, consult the content-addressed cache, call the step, store.

The CLI calls this in-process for every step; a Celery task calls it (in a child process)
for the one step it was given. Same function, so both paths behave alike.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.artifacts import Artifact
from services.descriptors import FormatDescriptor, engine_family, option_sections
from services.errors import ConversionFailed, EngineUnavailable, KilnError, SourceUnreadable, StorageFull
from services.formats import DetectedSource, Format
from services.graph.planner import PlanStep
from services.graph.registry import entry_path, load_entry
from services.outages import storage_full
from services.pipeline.memory import StepMemory
from services.spec import CompileSpec
from services.steps.context import Progress, StepContext
from services.steps.host_gate import host_share
from services.storage.base import ArtifactStore
from services.versions import tool_versions

if TYPE_CHECKING:
    from services.repository.base import ModelRepository

__all__ = ["StepCall", "StepOutcome", "call_step_function", "run_step", "source_artifact", "step_cache_key"]

#: Runs a step's function somewhere else (a confined child): returns its artifact and the memory
#: record of the process that ran it, or raises the step's KilnError.
StepCall = Callable[[StepContext], tuple[Artifact, dict[str, Any]]]


@dataclass
class StepOutcome:
    """What a finished step left behind."""

    step_id: str
    key: str | None  # artifact store key; None for steps that publish instead of producing
    artifact: Artifact
    cached: bool
    seconds: float
    meta: dict[str, Any] = field(default_factory=dict)


#: Spec fields each kind of step depends on. Conversions ignore precision, tolerances and
#: benchmark settings, so an fp16 or int8 job reuses the fp32 job's conversions and reference.
_SPEC_FIELDS: dict[str, set[str] | None] = {
    "reference": {"inputs", "validation", "calibration", "signature", "source_format", "evaluation"},
    "convert": {"inputs", "opset", "signature", "source_format", "max_batch_size"},
    "optimize": {"inputs", "opset", "signature", "source_format", "optimize"},
    "export": None,  # everything but naming: precision, tolerances, benchmark (and the engine's options)
}


def _spec_fingerprint(
    spec: CompileSpec,
    kind: str,
    calibration_sha: str | None,
    engine: str | None = None,
    evaluation_sha: str | None = None,
) -> dict[str, Any]:
    # Naming and scheduling do not change what a step produces.
    body = spec.model_dump(
        mode="json", exclude={"name", "version", "targets", "wait_for_workers", "require_device_check", "options"}
    )
    body["calibration"] = calibration_sha
    if body.get("evaluation") is None:
        body.pop("evaluation", None)  # a job without labelled data keeps the keys it always had
    else:
        body["evaluation"]["data"] = evaluation_sha  # the file's bytes matter, not its name
        if kind == "reference":  # it scores the source: the bound and the int8 search are the exports'
            body["evaluation"].pop("max_drop", None)
            body["evaluation"].pop("accuracy_aware_int8", None)
    # How Triton runs the artifact (instances, threads) changes its config.pbtxt, not the artifact.
    body.get("serving", {}).pop("triton", None)
    fields = _SPEC_FIELDS.get(kind)
    if fields is not None:
        body = {k: v for k, v in body.items() if k in fields}
    # An engine's own options (options.<engine>) reach only the steps its worker runs: setting
    # options.tensorrt rebuilds no onnxruntime artifact. A source format's options (how to read
    # the source) reach every step.
    options = {}
    family = engine_family(engine) if engine else None
    for name, d in option_sections().items():
        section = spec.options_for(name)
        if section is None:
            continue
        # A tune step builds for every engine it searches: every engine's options shape its output.
        if isinstance(d, FormatDescriptor) or (name == family and kind in ("convert", "export")) or kind == "tune":
            options[name] = section.model_dump(mode="json")
    if options:
        body["options"] = options
    return body


def _step_tools(step: PlanStep) -> dict[str, Any]:
    """Return the tool versions a step's output depends on: its engine's, or those of every engine it
    names in ``options.tool_engines`` (a tune step compares several engines in one step)."""
    engines = step.options.get("tool_engines")
    if not engines:
        return tool_versions(step.engine)
    tools: dict[str, Any] = {e: tool_versions(e) for e in sorted(engines)}
    if step.kind == "tune":
        # A tune's output is a measurement (and its thread grid follows the core count): an identical
        # tune on other hardware is not the same result.
        tools["host"] = {"cpus": os.cpu_count(), "machine": platform.machine(), "cpu": _cpu_model()}
    return tools


def _cpu_model() -> str:
    """Return the CPU's model name (Linux), or the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def step_cache_key(
    step: PlanStep,
    spec: CompileSpec,
    input_keys: dict[str, str],
    calibration_sha: str | None = None,
    evaluation_sha: str | None = None,
) -> str:
    """Return the content address of a step's output: inputs, step, options, spec and tool versions."""
    body = {
        # The function's path, not the step's name: a plan from before step names shares the cache.
        "entry": entry_path(step.entry),
        "kind": step.kind,
        "options": step.options,
        "inputs": dict(sorted(input_keys.items())),
        "spec": _spec_fingerprint(spec, step.kind, calibration_sha, step.engine, evaluation_sha),
        "tools": _step_tools(step),
    }
    digest = hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()
    return f"steps/{digest}"


def source_artifact(source: DetectedSource) -> Artifact:
    """Return the source model as an (unsaved) artifact the first steps read."""
    if source.path.is_dir():
        return Artifact(root=source.path, kind=source.format.value, meta={"sha256": source.sha256})
    return Artifact(
        root=source.path.parent, kind=source.format.value, entry=source.path.name, meta={"sha256": source.sha256}
    )


def _lineage(inputs: dict[str, Artifact], record: dict[str, Any]) -> list[dict[str, Any]]:
    """Return the de-duplicated history of steps that led to an artifact, reference first."""
    seen: set[str] = set()
    out: list[dict[str, Any]] = []
    for art in inputs.values():
        for rec in art.meta.get("lineage", []):
            if rec["step"] not in seen:
                seen.add(rec["step"])
                out.append(rec)
    out.sort(key=lambda rec: rec.get("kind") != "reference")  # stable: chain order otherwise kept
    out.append(record)
    return out


def _broken_intermediate(step: PlanStep, model: Artifact, exc: SourceUnreadable) -> ConversionFailed:
    """Return CONVERSION_FAILED naming the tool whose output ``step`` could not read."""
    lineage = model.meta.get("lineage") or []
    producer = lineage[-1] if lineage else {}
    tool = producer.get("tool") or model.meta.get("tool") or "the previous step"
    return ConversionFailed(
        f"{tool} (step {producer.get('step', '?')}) wrote a model that {step.tool} cannot read: {exc.message}",
        hint=f"The source model is fine; {tool} produced a broken {model.kind} model. Another route may avoid it.",
        step=producer.get("step", step.id),
        tool=tool,
        read_by=step.id,
        output_tail=exc.message[-2000:],
    )


def _source_unloadable(source: DetectedSource, model: Artifact) -> KilnError | None:
    """Return why onnxruntime cannot load an ONNX source, when a step failed reading that source's ONNX successor.

    The optimize step keeps what onnxruntime cannot load (a string op's locale, an opset it
    lacks), so an exporter that reads its output fails where the source itself would: the
    passes are not the cause.
    """
    if source.format is not Format.ONNX or model.kind != Format.ONNX.value:
        return None
    try:
        from services.runners.onnx import OnnxRuntimeRunner

        OnnxRuntimeRunner(source.path).close()
    except KilnError as err:
        err.message = f"the source model itself: {err.message}"
        err.args = (err.message,)
        return err
    except Exception:
        return None
    return None


def call_step_function(ctx: StepContext) -> Artifact:
    """Load the step's entry and run it on ``ctx``: the part of a step that touches the model."""
    try:
        func = load_entry(ctx.step.entry)
    except ImportError as exc:
        raise EngineUnavailable(
            f"step {ctx.step.id} needs {exc.name or ctx.step.entry}, which this process cannot import",
            hint=f"Run it on a worker serving {ctx.step.queue}, or install the {ctx.step.engine} extra.",
            step=ctx.step.id,
        ) from exc
    art: Artifact = func(ctx)
    return art


def run_step(step: PlanStep, *, store: ArtifactStore, **kwargs: Any) -> StepOutcome:
    """Run ``step`` (or take its output from the cache) while holding the store against pruning.

    See :func:`_run_step` for the arguments.
    """
    # A share of the host, so that a benchmark elsewhere on it waits for this step (host_gate);
    # a step run by a ``call`` takes it in the process that runs it.
    share = host_share() if kwargs.get("call") is None else contextlib.nullcontext()
    with store.in_use(), share:
        return _run_step(step, store=store, **kwargs)


def _run_step(
    step: PlanStep,
    *,
    job_id: str,
    spec: CompileSpec,
    source: DetectedSource,
    input_keys: dict[str, str],
    store: ArtifactStore,
    scratch: Path,
    repository: ModelRepository | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    calibration_path: Path | None = None,
    calibration_sha: str | None = None,
    evaluation_path: Path | None = None,
    evaluation_sha: str | None = None,
    use_cache: bool = True,
    route_attempts: list[dict[str, Any]] | None = None,
    call: StepCall | None = None,
) -> StepOutcome:
    """Run ``step`` (or take its output from the cache); return where its artifact is.

    ``input_keys`` maps each role of ``step.inputs`` to the store key of that input
    ("source" roles need no key). Any non-Kiln exception becomes CONVERSION_FAILED naming
    the step, the tool and the tail of the traceback. ``route_attempts`` (publish steps):
    the target's routes tried so far, for the manifest. ``call`` runs the step's function
    elsewhere (a sandboxed child, services/sandbox); this process then only fetches the
    inputs, and stores the output the call hands back.
    """
    started = time.perf_counter()
    memory = StepMemory.start()
    cacheable = step.kind != "publish"
    keys = {**input_keys, "source": source.sha256}
    key = step_cache_key(step, spec, keys, calibration_sha, evaluation_sha) if cacheable else None
    if key and use_cache and store.exists(key):
        hit_dir = store.local_path(key) or store.fetch_dir(key, scratch / "cache-hit" / key.replace("/", "_"))
        hit = Artifact.load(hit_dir)
        return StepOutcome(step.id, key, hit, True, time.perf_counter() - started, hit.meta)

    inputs: dict[str, Artifact] = {}
    for role, dep in step.inputs.items():
        if dep == "source":
            inputs[role] = source_artifact(source)
            continue
        dep_key = input_keys[role]
        local = store.local_path(dep_key)
        if local is None:
            local = store.fetch_dir(dep_key, scratch / "inputs" / role)
        inputs[role] = Artifact.load(local)

    out_dir = scratch / "out" / step.id.replace("/", "__").replace(":", "_")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    ctx = StepContext(
        job_id=job_id,
        step=step,
        spec=spec,
        source=source,
        inputs=inputs,
        out_dir=out_dir,
        scratch=scratch,
        repository=repository,
        on_progress=on_progress,
        extras={
            **({"calibration_path": calibration_path} if calibration_path else {}),
            **({"evaluation_path": evaluation_path} if evaluation_path else {}),
            **({"route_attempts": route_attempts} if route_attempts else {}),
        },
        input_keys=dict(input_keys),
        use_cache=use_cache,
    )
    try:
        if call is None:
            art, peak = call_step_function(ctx), memory.record()
        else:
            art, peak = call(ctx)
    except SourceUnreadable as exc:
        if step.inputs.get("model", "source") == "source":
            exc.details.setdefault("step", step.id)
            raise
        # The file that would not load is an intermediate artifact, not the user's model:
        # the tool that wrote it produced something broken, unless the same runtime cannot
        # load the user's model either (then that is the cause, said as such).
        if (cause := _source_unloadable(source, inputs["model"])) is not None:
            cause.details.setdefault("step", step.id)
            raise cause from exc
        raise _broken_intermediate(step, inputs["model"], exc) from exc
    except KilnError as exc:
        exc.details.setdefault("step", step.id)
        raise
    except Exception as exc:
        if storage_full(exc):
            raise StorageFull(f"step {step.id} ran out of disk space: {exc}", step=step.id) from exc
        tail = "".join(traceback.format_exception(exc))[-2000:]
        raise ConversionFailed(
            f"step {step.id} failed in {step.tool}: {type(exc).__name__}: {exc}",
            step=step.id,
            tool=step.tool,
            output_tail=tail,
        ) from exc
    seconds = time.perf_counter() - started
    record = {
        "step": step.id,
        "kind": step.kind,
        "tool": step.tool,
        "engine": step.engine,
        "seconds": round(seconds, 3),
        "tool_versions": tool_versions(step.engine),
        "report": {k: v for k, v in art.meta.items() if k not in ("lineage", "signature")},
        # Peak RSS of the process that ran the step, while it ran (with what it held before).
        **peak,
    }
    art.meta["lineage"] = _lineage(inputs, record)
    art.save()
    if key is None:
        return StepOutcome(step.id, None, art, False, seconds, art.meta)
    # The step's own output directory is scratch: a local store may take it over instead of
    # copying it. Anything else (a step handing back a directory it did not write) is copied.
    try:
        store.put_dir(key, art.root, move=Path(art.root).resolve() == out_dir.resolve())
    except OSError as exc:
        if storage_full(exc):
            raise StorageFull(
                f"the artifact store has no space for the output of step {step.id}", step=step.id
            ) from exc
        raise
    stored = store.local_path(key)
    if stored is not None:
        art = Artifact.load(stored)
    return StepOutcome(step.id, key, art, False, seconds, art.meta)
