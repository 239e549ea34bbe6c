"""Static vetting of uploads per format: SavedModel, TorchScript, ONNX and TFLite graphs that reach out are refused.

Every model is built here with the real framework; vetting itself imports none of them
(services/formats/{savedmodel,torchscript,onnx_model,tflite}.py). The refusals through a
real `kiln serve` are in tests/test_sandbox_service.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from hostile_models import file_reading_savedmodels, torchscript_vetting_bypass
from onnx import TensorProto, helper, numpy_helper

from services.errors import KilnError
from services.formats import open_source


def _refusal(path: Path, tmp_path: Path) -> KilnError:
    with pytest.raises(KilnError) as info:
        open_source(path, tmp_path / "work")
    return info.value


# --- TensorFlow SavedModel --------------------------------------------------------------


@pytest.fixture(scope="module")
def savedmodels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Build the SavedModels in a subprocess (TensorFlow stays out of this test process)."""
    root = tmp_path_factory.mktemp("savedmodels")
    script = f"""
import tensorflow as tf, keras
root = {str(root)!r}
class M(tf.Module):
    def __init__(self, body):
        super().__init__(); self.w = tf.Variable(tf.ones([4, 2])); self.body = body
    @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32)])
    def serve(self, x):
        return {{"y": self.body(self, x)}}
def snoop(self, x):
    env = tf.io.read_file("/proc/self/environ")
    tf.io.write_file(root + "/pwned", env)
    tf.print(env)
    return tf.matmul(x, self.w)
def checkpoint_writer(self, x):  # the saver's own op, called from the serving function
    tf.raw_ops.SaveV2(prefix=root + "/ckpt", tensor_names=["w"], shape_and_slices=[""], tensors=[self.w.read_value()])
    return tf.matmul(x, self.w)
def clean(self, x):
    return tf.nn.relu(tf.matmul(x, self.w))
for name, body in (("snoop", snoop), ("saver_in_serving", checkpoint_writer), ("clean", clean)):
    m = M(body); tf.saved_model.save(m, f"{{root}}/{{name}}", signatures={{"serving_default": m.serve}})
k = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3), keras.layers.BatchNormalization(),
                      keras.layers.Flatten(), keras.layers.Dense(2)])
k.export(root + "/keras")
"""
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, env={"TF_CPP_MIN_LOG_LEVEL": "3"})
    return {p.name: p for p in root.iterdir() if p.is_dir()}


def test_a_savedmodel_that_reads_writes_and_prints_is_refused_naming_the_ops(
    savedmodels: dict[str, Path], tmp_path: Path
) -> None:
    err = _refusal(savedmodels["snoop"], tmp_path)
    assert err.code == "UNSAFE_INPUT"
    assert err.details["ops"] == ["PrintV2", "ReadFile", "WriteFile"]
    assert any(f.startswith("__inference_serve") for f in err.details["functions"])
    assert not (savedmodels["snoop"].parent / "pwned").exists()  # vetting ran nothing


def test_the_savers_file_ops_are_refused_outside_the_saver(savedmodels: dict[str, Path], tmp_path: Path) -> None:
    err = _refusal(savedmodels["saver_in_serving"], tmp_path)
    assert err.code == "UNSAFE_INPUT" and err.details["ops"] == ["SaveV2"]


def test_savedmodels_of_plain_tensor_programs_pass_with_their_saver(
    savedmodels: dict[str, Path], tmp_path: Path
) -> None:
    from services.formats.savedmodel import _parse, savedmodel_ops

    for name in ("clean", "keras"):
        source = open_source(savedmodels[name], tmp_path / name)
        assert source.format.value == "savedmodel"
        ops = savedmodel_ops(_parse(savedmodels[name] / "saved_model.pb"))
        # The saver's SaveV2/RestoreV2 are left out because only the saver reaches them.
        assert {"VarHandleOp", "ReadVariableOp", "MatMul", "StatefulPartitionedCall"} <= set(ops)
        assert not {"SaveV2", "RestoreV2", "MergeV2Checkpoints"} & set(ops)
    assert "Conv2D" in savedmodel_ops(_parse(savedmodels["keras"] / "saved_model.pb"))


def test_the_op_allowlist_is_reviewed_op_by_op_and_names_no_file_reader() -> None:
    """Every allowed op exists in this TensorFlow and none has an attribute or input that names a file."""
    out = subprocess.run(
        [sys.executable, "-c", "import json, savedmodel_allowlist as s; print(json.dumps(s.problems()))"],
        check=True,
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent,
        env={"TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(Path(__file__).parents[1])},
    ).stdout
    assert json.loads(out.strip().splitlines()[-1]) == {}
    from services.formats.savedmodel_ops import ALLOWED_TF_OPS, REFUSED_EXAMPLES

    assert not ALLOWED_TF_OPS & REFUSED_EXAMPLES
    assert {"ImmutableConst", "FixedUnigramCandidateSampler", "FIFOQueueV2", "ReadFile"} <= REFUSED_EXAMPLES
    assert {
        "Conv2D",
        "MatMul",
        "While",
        "StatefulPartitionedCall",
        "VarHandleOp",
        "TensorListReserve",
        "HashTableV2",
        "UniformCandidateSampler",
    } <= ALLOWED_TF_OPS


def test_savedmodel_ops_that_read_a_file_named_by_an_attribute_are_refused(tmp_path: Path) -> None:
    """FixedUnigramCandidateSampler(vocab_file) reads a file into its error; ImmutableConst maps one."""
    built = file_reading_savedmodels(tmp_path, "/etc/passwd")
    for name, op in (("sampler", "FixedUnigramCandidateSampler"), ("mapped", "ImmutableConst")):
        err = _refusal(built[name], tmp_path / name)
        assert err.code == "UNSAFE_INPUT" and err.details["ops"] == [op], (name, err.to_dict())


# --- TorchScript -------------------------------------------------------------------------


def test_torchscript_code_that_does_file_io_or_prints_is_refused(tmp_path: Path) -> None:
    import torch

    class Snoop(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            secret = torch.from_file("/etc/hostname", False, 8, dtype=torch.uint8)
            print(secret)
            torch.save(x, "/tmp/kiln-pwned")
            return x + secret.float().sum() * 0

    class Clean(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.bn = torch.nn.Linear(4, 2), torch.nn.BatchNorm1d(2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.relu(self.bn(self.lin(x)))
            if y.size(0) > 1:
                y = y.flatten(1)
            return torch.cat([y, y.mean(dim=1, keepdim=True)], 1)

    torch.jit.script(Snoop()).save(str(tmp_path / "snoop.pt"))
    torch.jit.script(Clean()).save(str(tmp_path / "scripted.pt"))
    torch.jit.trace(Clean().eval(), torch.ones(2, 4)).save(str(tmp_path / "traced.pt"))
    err = _refusal(tmp_path / "snoop.pt", tmp_path)
    assert err.code == "UNSAFE_INPUT"
    assert err.details["ops"] == ["aten::from_file", "aten::save", "prim::Print"]
    for name in ("scripted", "traced"):  # nn layers' own TorchScript (batch_norm checks, RaiseException) passes
        assert open_source(tmp_path / f"{name}.pt", tmp_path / name).format.value == "torchscript"


def test_torchscript_vetting_refuses_other_namespaces_classes_and_torch_as_a_value() -> None:
    from services.formats.torchscript import torchscript_calls

    code = (
        "def forward(self, x: Tensor) -> Tensor:\n"
        "  a = ops.c10d.allreduce_(x)\n"
        "  b = torch.ops.profiler._record_function_enter(x)\n"
        "  c : __torch__.torch.classes.myns.Thing = torch.classes.myns.Thing()\n"
        "  t = torch\n"
        "  return ops.prim.NumToTensor(torch.add(x, 1))\n"
    )
    assert torchscript_calls(code) == {
        "c10d::allreduce_",
        "profiler::_record_function_enter",
        "torch.classes.myns.Thing",
        "torch used as a value",
    }


def test_the_torchscript_denylist_covers_every_operator_with_a_file_argument() -> None:
    """Within the allowed namespaces, every schema taking a file name or path is denied (checked against torch)."""
    import torch

    from services.formats.torchscript import ALLOWED_NAMESPACES, DENIED_OPS

    file_ops = {
        s.name
        for s in torch._C._jit_get_all_schemas()
        if s.name.split("::")[0] in ALLOWED_NAMESPACES
        and any("str" in str(a.type) and any(k in a.name.lower() for k in ("file", "path", "dir")) for a in s.arguments)
    }
    assert file_ops and file_ops <= DENIED_OPS
    assert "prim::Print" in DENIED_OPS


def test_the_reported_torchscript_bypass_is_refused_with_the_format_forced(tmp_path: Path) -> None:
    """Issue 31, attack 1: no debug_pkl, 0xFF in a comment, models/x.json, "source_format": "torchscript"."""
    from services.formats import Format

    model = torchscript_vetting_bypass(tmp_path / "bypass.pt", "/etc/passwd")
    with pytest.raises(KilnError) as info:
        open_source(model, tmp_path / "work", Format.TORCHSCRIPT)
    err = info.value
    assert err.code == "UNSAFE_INPUT", err.to_dict()
    # (torch names the class's file __torch__/hostile_models[/___torch_mangle_N].py when it scripted it before)
    assert "byte 0xff" in err.message and err.details["files"][0].startswith("__torch__/hostile_models")


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (b"  # a plain comment\n", "a comment at line"),
        (b"  x = 1\r\n", "byte 0x0d"),
        (b"\tx = 1\n", "byte 0x09"),
        (b"  s = r'raw'\n", "prefixed or triple-quoted string"),
        (b'  s = """a"""\n', "prefixed or triple-quoted string"),
        (b"  y = 1 + \\\n    2\n", "backslash line continuation"),
    ],
)
def test_torchscript_code_not_in_the_form_torch_writes_is_refused(tmp_path: Path, edit: bytes, why: str) -> None:
    """Where Python's tokenizer and torch's lexer may disagree, vetting refuses instead of guessing."""
    import zipfile

    import torch

    from services.formats.torchscript import vet_torchscript

    class Plain(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2.0

    plain, edited = tmp_path / "plain.pt", tmp_path / "edited.pt"
    torch.jit.script(Plain()).save(str(plain))
    vet_torchscript(plain)  # as saved: passes
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(edited, "w") as out:
        for info in src.infolist():
            data = src.read(info)
            if "/code/" in info.filename and info.filename.endswith(".py"):
                data = data.replace(b"  def forward", edit + b"  def forward", 1)
            out.writestr(info, data)
    with pytest.raises(KilnError) as info:
        vet_torchscript(edited)
    assert info.value.code == "UNSAFE_INPUT" and why in info.value.message, info.value.message


def test_torchs_own_parser_must_read_every_function_as_python_does() -> None:
    """The cross-check: a name only torch's parser sees (here: source and tree disagree on purpose) refuses."""
    import ast

    from services.formats.torchscript import torch_parser_problem

    seen_by_python = ast.parse("def forward(self, x: Tensor) -> Tensor:\n  return x\n")
    same = "def forward(self, x: Tensor) -> Tensor:\n  return x\n"
    other = "def forward(self, x: Tensor) -> Tensor:\n  return torch.from_file(x)\n"
    assert torch_parser_problem(same, seen_by_python) is None
    problem = torch_parser_problem(other, seen_by_python)
    assert problem is not None and "from_file" in problem and "torch" in problem


# --- ONNX --------------------------------------------------------------------------------


def _onnx_model(
    nodes: list[onnx.NodeProto], *, functions: list[onnx.FunctionProto] = (), extra_opsets=()
) -> onnx.ModelProto:  # type: ignore[assignment]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    opsets = [helper.make_opsetid("", 17), *[helper.make_opsetid(d, 1) for d in extra_opsets]]
    return helper.make_model(graph, opset_imports=opsets, functions=list(functions))


def test_onnx_nodes_of_a_code_running_custom_domain_are_refused(tmp_path: Path) -> None:
    # onnxruntime-extensions registers Python functions (@onnx_op) as ops of ai.onnx.contrib.
    py_op = helper.make_node("PyReverseMatrix", ["x"], ["t"], domain="ai.onnx.contrib")
    inner = helper.make_graph(
        [helper.make_node("MyCustomOp", ["x"], ["z"], domain="com.example.ops")],
        "then",
        [],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 4])],
    )
    cond = helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.array(True)))
    branch = helper.make_node("If", ["c"], ["u"], then_branch=inner, else_branch=inner)
    add = helper.make_node("Add", ["t", "u"], ["y"])
    model = _onnx_model([py_op, cond, branch, add], extra_opsets=["ai.onnx.contrib", "com.example.ops"])
    onnx.save(model, tmp_path / "custom.onnx")
    err = _refusal(tmp_path / "custom.onnx", tmp_path)
    assert err.code == "UNSAFE_INPUT"
    assert err.details["ops"] == ["ai.onnx.contrib::PyReverseMatrix", "com.example.ops::MyCustomOp"]


def test_onnx_standard_contrib_and_local_function_domains_pass(tmp_path: Path) -> None:
    body = helper.make_function(
        "local.fns", "Double", ["a"], ["b"], [helper.make_node("Add", ["a", "a"], ["b"])], [helper.make_opsetid("", 17)]
    )
    nodes = [
        helper.make_node("Double", ["x"], ["d"], domain="local.fns"),
        helper.make_node("Gelu", ["d"], ["y"], domain="com.microsoft"),
    ]
    onnx.save(_onnx_model(nodes, functions=[body], extra_opsets=["local.fns", "com.microsoft"]), tmp_path / "ok.onnx")
    assert open_source(tmp_path / "ok.onnx", tmp_path / "w").format.value == "onnx"


@pytest.mark.parametrize("location", ["/proc/self/environ", "../secret.bin", "data/../../secret.bin", "link.bin"])
def test_onnx_external_data_outside_the_models_folder_is_refused(tmp_path: Path, location: str) -> None:
    folder = tmp_path / "model"
    (folder / "data").mkdir(parents=True)
    (tmp_path / "secret.bin").write_bytes(b"s3cr3t-value-16b")
    (folder / "link.bin").symlink_to(tmp_path / "secret.bin")
    weight = numpy_helper.from_array(np.zeros(4, np.float32), "w")
    weight.ClearField("raw_data")
    weight.data_location = TensorProto.EXTERNAL
    weight.external_data.add(key="location", value=location)
    weight.external_data.add(key="length", value="16")
    model = _onnx_model([helper.make_node("Add", ["x", "w"], ["y"])])
    model.graph.initializer.append(weight)
    onnx.save(model, folder / "model.onnx")
    err = _refusal(folder / "model.onnx", tmp_path)
    assert err.code == "UNSAFE_INPUT" and err.details["tensor"] == "w"


def test_onnx_external_data_inside_a_local_function_is_refused(tmp_path: Path) -> None:
    """A model-local function's Constant whose value lives in /proc/self/environ (onnx refused it only later)."""
    folder = tmp_path / "model"
    folder.mkdir()
    value = numpy_helper.from_array(np.zeros(4, np.float32), "leak")
    value.ClearField("raw_data")
    value.data_location = TensorProto.EXTERNAL
    value.external_data.add(key="location", value="/proc/self/environ")
    value.external_data.add(key="length", value="16")
    body = helper.make_function(
        "local.fns",
        "Leak",
        ["a"],
        ["b"],
        [helper.make_node("Constant", [], ["c"], value=value), helper.make_node("Add", ["a", "c"], ["b"])],
        [helper.make_opsetid("", 17)],
    )
    model = _onnx_model(
        [helper.make_node("Leak", ["x"], ["y"], domain="local.fns")], functions=[body], extra_opsets=["local.fns"]
    )
    onnx.save(model, folder / "model.onnx")
    err = _refusal(folder / "model.onnx", tmp_path)
    assert err.code == "UNSAFE_INPUT" and err.details["tensor"] == "leak", err.to_dict()


def test_an_onnx_file_protobuf_cannot_parse_is_refused_not_passed_to_a_loader(tmp_path: Path) -> None:
    from services.formats import Format

    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"\x08\x07" + b"\xff" * 64)  # looks like ONNX to detection, does not parse
    with pytest.raises(KilnError) as info:
        open_source(broken, tmp_path / "work", Format.ONNX)
    assert info.value.code == "SOURCE_UNREADABLE"


# --- every format: the format vetted is the format loaded -----------------------------------


def _source_formats() -> list[str]:
    from services.descriptors import registry

    return sorted(n for n, f in registry().formats.items() if f.is_source)


#: Formats whose loader vets the file as it reads it, with the same check for both sides (a
#: worker opens sources with open_source too): what they check, and where.
LOADER_VETTED = {
    "keras": "services.formats.keras_safety:check_keras_file (Lambda bytecode, before keras loads)",
    "torch_export": "services.runners.torch_archives:check_pt2_archive (pickles, expressions, guards)",
    "openvino_ir": "no code: OpenVINO IR is XML and weights; a custom layer needs an extension no step loads",
}


@pytest.mark.parametrize("fmt", _source_formats())
def test_every_source_format_is_vetted_as_itself_when_the_spec_forces_it(
    fmt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forcing ``fmt`` onto a file of another kind (an ONNX model) runs ``fmt``'s vetter, and whatever that
    vetter raises refuses the upload: its refusal as it is, anything else (a bug) as SOURCE_UNREADABLE."""
    import importlib

    from services.descriptors import registry
    from services.errors import UnsafeInput
    from services.formats import Format

    desc = registry().formats[fmt]
    entry = desc.vet or desc.loadable
    if entry is None:
        assert fmt in LOADER_VETTED, f"{fmt} has no vetter: add FormatDescriptor.vet (or say why its loader is safe)"
        return
    module, _, func = entry.partition(":")
    model = tmp_path / "model.bin"
    onnx.save(_onnx_model([helper.make_node("Relu", ["x"], ["y"])]), model)
    if fmt == "onnx":  # an ONNX file is onnx already: force it onto bytes of no known kind instead
        model.write_bytes(b"no model Kiln knows")

    def refuse(path: Path) -> None:
        raise UnsafeInput(f"refused by the {fmt} vetter")

    def crash(path: Path) -> None:
        raise RuntimeError(f"the {fmt} vetter hit a bug")

    for vetter, code, words in ((refuse, "UNSAFE_INPUT", "refused by the"), (crash, "SOURCE_UNREADABLE", "hit a bug")):
        monkeypatch.setattr(importlib.import_module(module), func, vetter)
        with pytest.raises(KilnError) as info:
            open_source(model, tmp_path / "work", Format(fmt))
        assert info.value.code == code and f"{words}" in info.value.message and fmt in info.value.message


# --- TFLite ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tflite_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tflite")
    script = f"""
import tensorflow as tf
root = {str(root)!r}
@tf.function(input_signature=[tf.TensorSpec([1, 4], tf.float32)])
def snoop(x):  # file reads reach TFLite as Flex (TensorFlow) custom ops
    return x * 2.0 + tf.cast(tf.strings.length(tf.io.read_file("/etc/hostname")), tf.float32)
@tf.function(input_signature=[tf.TensorSpec([1, 4], tf.float32)])
def plain(x):
    return tf.nn.relu(x * 2.0)
for name, f, ops in (("flex", snoop, [tf.lite.OpsSet.TFLITE_BUILTINS, tf.lite.OpsSet.SELECT_TF_OPS]),
                     ("plain", plain, [tf.lite.OpsSet.TFLITE_BUILTINS])):
    c = tf.lite.TFLiteConverter.from_concrete_functions([f.get_concrete_function()], f)
    c.target_spec.supported_ops = ops
    open(f"{{root}}/{{name}}.tflite", "wb").write(c.convert())
"""
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, env={"TF_CPP_MIN_LOG_LEVEL": "3"})
    return root


def test_a_tflite_model_with_custom_ops_is_refused_naming_them(tflite_models: Path, tmp_path: Path) -> None:
    err = _refusal(tflite_models / "flex.tflite", tmp_path)
    assert err.code == "UNSAFE_INPUT"
    assert err.details["ops"] == ["FlexReadFile", "FlexStringLength"]
    assert open_source(tflite_models / "plain.tflite", tmp_path / "p").format.value == "tflite"


def test_vetting_can_be_turned_off_for_sandbox_tests_only(tflite_models: Path, tmp_path: Path) -> None:
    assert open_source(tflite_models / "flex.tflite", tmp_path, vet=False).format.value == "tflite"
    from pydantic import ValidationError

    from services.settings import Settings

    with pytest.raises(ValidationError, match="KILN_VET_UPLOADS"):
        Settings(
            environment="production",
            auth_enabled=True,
            database_url="postgresql://x/y",
            broker_url="redis://x",
            vet_uploads=False,
        )
