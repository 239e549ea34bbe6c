"""The descriptor registry: every table is derived from it, and a new engine is one module.

The last test adds an engine the way a plugin (or a new file in services/descriptors/) does:
one module of descriptors, an exporter and a runner, and nothing else in Kiln changed. It
is then a target of the spec and of `kiln compile`, with its own options, queue, worker
preload, tool versions and repository root.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from jobs_support import KILN_CMD
from pydantic import BaseModel

from services.descriptors import (
    ConverterDescriptor,
    EngineDescriptor,
    FormatDescriptor,
    Registry,
    TargetDescriptor,
    WorkerImage,
    concrete_engines,
    registry,
)

ROOT = Path(__file__).resolve().parents[1]


def test_enums_are_the_registered_formats_and_targets_built_ins_first() -> None:
    from services.formats import Format
    from services.spec import TargetName

    assert [f.value for f in Format] == list(registry().formats)
    assert [t.value for t in TargetName] == list(registry().targets)
    assert [f.value for f in Format][:8] == [
        "onnx",
        "keras",
        "savedmodel",
        "tflite",
        "torchscript",
        "torch_export",
        "openvino_ir",
        "tensorrt_plan",
    ]
    assert [t.value for t in TargetName][:5] == ["onnxruntime", "openvino", "tflite", "tfserving", "tensorrt"]
    assert Format("onnx") is Format.ONNX and TargetName.TENSORRT.value == "tensorrt"


def test_derived_tables_match_the_descriptors() -> None:
    from services.graph.engines import ENGINES
    from services.graph.registry import default_registry, source_engine
    from services.repository.layouts import ROOTS, server_root
    from services.runners.base import _RUNNERS
    from services.versions import ENGINE_PACKAGES, tool_versions
    from workers.child import _ENGINE_PRELOAD
    from workers.queues import all_queues

    reg = registry()
    assert list(ENGINES)[:5] == ["onnxruntime", "openvino", "tensorflow", "tensorrt-cu12", "tensorrt-cu13"]
    assert list(ENGINES) == list(concrete_engines())
    assert ENGINES["tensorrt-cu12"].description == "TensorRT 10.x on CUDA 12"
    assert all_queues() == [f"kiln.{e}" for e in ENGINES]
    assert ENGINE_PACKAGES["tensorrt"][0] == "tensorrt" and set(ENGINE_PACKAGES) == set(reg.engines)
    assert "openvino" in tool_versions("openvino") and "tensorrt" not in tool_versions("tensorrt-cu13")
    assert {"onnxruntime", "openvino"} <= set(_ENGINE_PRELOAD)
    assert not {"tensorflow", "tensorrt-cu13"} & set(_ENGINE_PRELOAD)  # TensorFlow and torch are not fork-safe
    assert {f.value: e for f, e in _RUNNERS.items()} == {f.name: f.runner for f in reg.formats.values()}
    graph = default_registry()
    assert {c.name for c in graph.converters} == set(reg.converters)
    assert {e.target.value for e in graph.exporters} == set(reg.targets)
    assert graph.engines() == set(reg.engines) >= {"onnxruntime", "openvino", "tensorflow", "tensorrt"}
    from services.formats import Format

    assert source_engine(Format.KERAS) == "tensorflow" and source_engine(Format.TORCHSCRIPT) == "onnxruntime"
    assert source_engine(Format.TENSORRT_PLAN) == "tensorrt"  # read by its engine, refused as a source
    assert ROOTS[:3] == ("triton", "tfserving", "tflite")
    assert set(ROOTS) == {t.server_root for t in reg.targets.values()}
    assert [server_root(t, {}) for t in ("onnxruntime", "tensorrt", "tfserving", "tflite")] == [
        "triton",
        "triton",
        "tfserving",
        "tflite",
    ]


def test_unsupported_format_hint_lists_every_source_format() -> None:
    from services.errors import UnsupportedFormat

    hint = UnsupportedFormat("x").hint
    assert hint.startswith(
        "Kiln reads ONNX, Keras (.keras/.h5), TF SavedModel (dir/.zip/.tar.gz), TFLite, "
        "TorchScript (.pt), torch.export (.pt2)"
    )  # the hint main had, word for word, with any source format registered since after it
    assert hint.endswith("; set `source_format` in the spec if detection guessed wrong.")
    for f in registry().formats.values():
        assert (f.label in hint) is f.is_source, f.name
    assert "TensorRT" not in hint  # a plan is no source
    assert UnsupportedFormat("x", hint="own").hint == "own"


def test_every_engine_installs_from_a_pyproject_extra() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for engine in registry().engines.values():
        assert engine.extra in extras, engine.name
        assert set(engine.image.extras) <= set(extras), engine.name
        assert engine.extra in engine.image.extras and "service" in engine.image.extras, engine.name
        assert (ROOT / engine.image.dockerfile).is_file(), engine.name


def _engine(name: str, **kw: object) -> EngineDescriptor:
    return EngineDescriptor(name, name, ("onnx",), "onnxruntime", ("onnx",), WorkerImage(("onnxruntime",)), **kw)  # type: ignore[arg-type]


def test_registry_refuses_clashes_and_dangling_names() -> None:
    fmt = FormatDescriptor("demo", "Demo", None, source_engine="e1")
    Registry.build([("m", [_engine("e1"), fmt])])  # consistent: accepted
    with pytest.raises(ValueError, match=r"m2: engine 'e1' is already registered by m1"):
        Registry.build([("m1", [_engine("e1")]), ("m2", [_engine("e1")])])
    with pytest.raises(ValueError, match=r"format 'demo' names unknown engine 'nope'"):
        Registry.build([("m", [FormatDescriptor("demo", "Demo", None, source_engine="nope")])])
    with pytest.raises(ValueError, match=r"say why in not_a_source"):
        Registry.build([("m", [FormatDescriptor("demo", "Demo", None)])])
    with pytest.raises(ValueError, match=r"converter 'a-to-b' names unknown format 'b'"):
        Registry.build([("m", [_engine("e1"), fmt, ConverterDescriptor("a-to-b", "demo", "b", "e1", 1.0, "m:f", "t")])])
    with pytest.raises(ValueError, match=r"target 't' names unknown format 'nope'"):
        Registry.build([("m", [_engine("e1"), fmt, TargetDescriptor("t", "e1", {"nope": 1.0}, "m:f", "demo", "r")])])

    class NoVariant(BaseModel):
        level: int = 1

    with pytest.raises(ValueError, match=r"needs a `variant` field"):
        Registry.build([("m", [_engine("e1", variants={"a": "A"}, default_variant="a", options=NoVariant)])])
    with pytest.raises(ValueError, match="two descriptors contribute spec options under one name"):
        Registry.build(
            [
                (
                    "m",
                    [
                        _engine("demo", options=NoVariant),
                        FormatDescriptor("demo", "D", None, "demo", options=NoVariant),
                    ],
                )
            ]
        )
    with pytest.raises(ValueError, match="is not a descriptor"):
        Registry.build([("m", ["onnx"])])  # type: ignore[list-item]


def test_tensorrt_options_old_and_new_spelling() -> None:
    from services.descriptors.tensorrt import TensorRTOptions
    from services.errors import InvalidSpec
    from services.graph.planner import resolve_engine
    from services.spec import load_spec

    new = load_spec({"targets": ["tensorrt"], "options": {"tensorrt": {"variant": "cu12", "workspace_mb": 512}}})
    old = load_spec({"targets": ["tensorrt"], "tensorrt_variant": "cu12", "tensorrt_workspace_mb": 512})
    assert new == old and new.model_dump(mode="json") == old.model_dump(mode="json")
    assert new.engine_options(TensorRTOptions) == TensorRTOptions(variant="cu12", workspace_mb=512)
    assert resolve_engine("tensorrt", new) == "tensorrt-cu12"
    assert resolve_engine("tensorrt", load_spec({"targets": ["tensorrt"]})) == "tensorrt-cu13"
    assert resolve_engine("openvino", new) == "openvino"
    assert "tensorrt_variant" not in new.model_dump()  # one canonical spelling is stored
    with pytest.raises(InvalidSpec) as exc:
        load_spec({"targets": ["tensorrt"], "tensorrt_variant": "cu12", "options": {"tensorrt": {"variant": "cu13"}}})
    assert "not both" in exc.value.message
    with pytest.raises(InvalidSpec) as exc:
        load_spec({"targets": ["tensorrt"], "options": {"tensorrt": {"variant": "cuda12"}}})
    assert [e["field"] for e in exc.value.details["errors"]] == ["options.tensorrt.variant"]
    with pytest.raises(InvalidSpec) as exc:
        load_spec({"targets": ["tensorrt"], "options": {"tvm_typo": {}}})
    assert [e["field"] for e in exc.value.details["errors"]] == ["options.tvm_typo"]


def test_engine_options_reach_only_their_engines_cache_keys() -> None:
    from services.graph.planner import PlanStep
    from services.pipeline.executor import step_cache_key
    from services.spec import load_spec

    def key(engine: str, workspace: int) -> str:
        spec = load_spec({"targets": ["onnxruntime", "tensorrt"], "options": {"tensorrt": {"workspace_mb": workspace}}})
        step = PlanStep("export:x", "export", engine, "m:f", inputs={"model": "source"}, options={"precision": "fp32"})
        return step_cache_key(step, spec, {"model": "k"})

    assert key("onnxruntime", 512) == key("onnxruntime", 1024)
    assert key("tensorrt-cu13", 512) != key("tensorrt-cu13", 1024)


# --- a new engine is one module -----------------------------------------------------------------

_PLUGIN = '''
"""A demo engine: ONNX models re-published as a "demo_onnx" artifact, run on onnxruntime."""

from pydantic import BaseModel, ConfigDict, Field

from services.descriptors import EngineDescriptor, FormatDescriptor, TargetDescriptor, WorkerImage


class DemoOptions(BaseModel):
    """Demo engine settings (options.democopy)."""

    model_config = ConfigDict(extra="forbid")
    note: str = Field(default="plain", description="Recorded in the manifest's engine_details.")


class DemoSourceOptions(BaseModel):
    """How to read a demo source (options.demo_src)."""

    model_config = ConfigDict(extra="forbid")
    task: str = "copy"


def sniff(path):
    """Return what was seen when ``path`` is a demo source (a file starting with DEMO), else None."""
    return "DEMO magic" if path.is_file() and path.read_bytes()[:4] == b"DEMO" else None


DESCRIPTORS = (
    FormatDescriptor(
        name="demo_src",
        label="Demo source (.demo)",
        runner=None,
        source_engine="democopy",
        detect="kiln_demo.descriptors:sniff",
        options=DemoSourceOptions,
    ),
    EngineDescriptor(
        name="democopy",
        description="A demo engine registered by a plugin",
        modules=("onnxruntime",),
        extra="onnxruntime",
        packages=("onnxruntime", "numpy"),
        image=WorkerImage(extras=("onnxruntime", "service")),
        preload=("onnxruntime",),
        options=DemoOptions,
    ),
    FormatDescriptor(
        name="demo_onnx",
        label="Demo ONNX",
        runner="kiln_demo.engine:DemoRunner",
        not_a_source=("a demo artifact is an output only", "Submit the ONNX model."),
    ),
    TargetDescriptor(
        name="democopy",
        engine="democopy",
        accepts={"onnx": 1.0},
        entry="kiln_demo.engine:export_democopy",
        artifact_format="demo_onnx",
        server_root="demo",
        precisions={"onnx": frozenset({"fp32"})},
    ),
)
'''

_ENGINE = """
import shutil

from services.exporters._common import finish_export
from services.formats import Format
from services.runners.onnx import OnnxRuntimeRunner
from services.spec import Precision


class DemoRunner(OnnxRuntimeRunner):
    pass


def export_democopy(ctx):
    shutil.copyfile(ctx.model.path, ctx.out_dir / "model.onnx")
    note = ctx.spec.options_for("democopy").note
    return finish_export(
        ctx, fmt=Format("demo_onnx"), entry="model.onnx", precision=Precision.FP32, serving={},
        engine_details={"democopy": {"note": note}},
    )
"""


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Return an environment whose Python sees the demo engine's distribution (entry point kiln.descriptors)."""
    site = tmp_path_factory.mktemp("site")
    pkg = site / "kiln_demo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "descriptors.py").write_text(_PLUGIN)
    (pkg / "engine.py").write_text(_ENGINE)
    info = site / "kiln_demo-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kiln-demo\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[kiln.descriptors]\ndemo = kiln_demo.descriptors\n")
    path = os.pathsep.join(p for p in (str(site), str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "COLUMNS": "200"}


_PROBE = """
import json
import sys
from pathlib import Path
from services.errors import UnsupportedFormat
from services.formats import detect_format
from services.formats import Format
from services.spec import TargetName, spec_json_schema
from services.graph.engines import ENGINES
from services.versions import tool_versions
from services.repository.layouts import ROOTS
from workers.child import preload_modules
from workers.queues import all_queues
from services.deploy_snippets import snippets
schema = spec_json_schema()
print(json.dumps({
    "format": Format("demo_onnx").value,
    "target": TargetName("democopy").name,
    "engine": ENGINES["democopy"].description,
    "queues": all_queues(),
    "tools": sorted(tool_versions("democopy")),
    "roots": list(ROOTS),
    "preload": "onnxruntime" in preload_modules(["democopy"]),
    "targets_enum": schema["$defs"]["TargetName"]["enum"],
    "options": sorted(schema["$defs"]["EngineOptions"]["properties"]),
    "snippet": snippets("democopy"),
    "detected": detect_format(Path(sys.argv[1])),
    "hint": UnsupportedFormat("x").hint,
}))
"""


def test_a_plugin_engine_is_derived_everywhere(plugin_env: dict[str, str], tmp_path: Path) -> None:
    demo = tmp_path / "m.demo"
    demo.write_bytes(b"DEMO and some bytes")
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, str(demo)], env=plugin_env, capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    assert seen["format"] == "demo_onnx" and seen["target"] == "DEMOCOPY"
    assert seen["engine"] == "A demo engine registered by a plugin"
    assert seen["queues"][-1] == "kiln.democopy"
    assert seen["tools"] == ["kiln", "numpy", "onnxruntime", "python"]
    assert seen["roots"][:3] == ["triton", "tfserving", "tflite"] and seen["roots"][-1] == "demo"
    assert seen["preload"] is True
    assert seen["targets_enum"][-1] == "democopy"
    assert {"democopy", "demo_src", "tensorrt"} <= set(seen["options"])
    assert seen["detected"] == ["demo_src", "DEMO magic"]  # the plugin's sniffer, after the built-in rules
    # Every source's label, the plugin's last (built-in ones from the registry: adding a source edits no test).
    labels = [f.label for f in registry().formats.values() if f.is_source]
    assert f"{labels[-1]} and Demo source (.demo);" in seen["hint"]
    assert all(label in seen["hint"] for label in labels)
    assert "worker-democopy:" in seen["snippet"] and "ENGINE: democopy" in seen["snippet"]


def test_a_plugin_engine_compiles_end_to_end(plugin_env: dict[str, str], cnn_onnx: Path, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"targets": ["democopy", "onnxruntime"], "options": {"democopy": {"note": "hello"}}}))
    proc = subprocess.run(
        [
            *KILN_CMD,
            "compile",
            str(cnn_onnx),
            "--spec",
            str(spec),
            "--repo",
            str(repo),
            "--name",
            "cnn",
            "--cache-dir",
            str(tmp_path / "cache"),
            "-q",
        ],
        env=plugin_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    manifest = json.loads((repo / "demo" / "cnn-democopy" / "1" / "kiln-manifest.json").read_text())
    assert manifest["engine_details"] == {"democopy": {"note": "hello"}}
    assert manifest["parity"]["passed"] is True
    assert (repo / "demo" / "cnn-democopy" / "1" / "model.onnx").is_file()
    assert (repo / "triton" / "cnn-onnxruntime" / "1" / "model.onnx").is_file()
    routes = subprocess.run([*KILN_CMD, "routes"], env=plugin_env, capture_output=True, text=True, timeout=120)
    assert routes.returncode == 0 and re.search(r"democopy\s*│\s*democopy\s*│\s*onnx \(1\)", routes.stdout), (
        routes.stdout
    )
    assert "democopy" not in concrete_engines()  # the plugin lives in the subprocesses only


def test_deploy_snippets_follow_the_descriptors() -> None:
    from services.deploy_snippets import compose_worker, helm_worker

    svc = compose_worker("openvino")
    assert svc["build"]["args"]["EXTRAS"] == "openvino,service" and "profiles" not in svc
    assert compose_worker("tensorrt-cu12")["profiles"] == ["gpu", "gpu-cu12"]
    assert helm_worker("tensorrt-cu13")["enabled"] is False and helm_worker("tensorflow")["gpus"] == 0
