"""Tiny models built in the tests with random weights (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def _torch():
    import torch

    torch.manual_seed(0)
    return torch


def with_bn_statistics(
    model: Any,
    mean: tuple[float, float] = (-0.5, 0.5),
    var: tuple[float, float] = (0.5, 2.0),
    weight: tuple[float, float] | None = None,
    bias: tuple[float, float] | None = None,
) -> Any:
    """Return ``model`` with each BatchNorm2d's statistics (and affine terms, given ranges) drawn uniformly.

    A fresh BatchNorm (mean 0, variance 1, weight 1, bias 0) folds into the convolution before
    it as nothing at all; drawn statistics give the folding and the converters something to
    get wrong. Draws from torch's global generator, module by module: mean, var, weight, bias.
    """
    import torch

    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(*mean)
                m.running_var.uniform_(*var)
                if weight is not None:
                    m.weight.uniform_(*weight)
                if bias is not None:
                    m.bias.uniform_(*bias)
    return model


def tiny_cnn_module():
    """Conv, BatchNorm (non-trivial statistics), ReLU, pooling and Gemm: a 10-class classifier."""
    torch = _torch()
    nn = torch.nn

    class TinyCNN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.features = nn.Sequential(
                nn.Conv2d(3, 8, 3, padding=1),
                nn.BatchNorm2d(8),
                nn.ReLU(),
                nn.MaxPool2d(2),
                nn.Conv2d(8, 16, 3, padding=1),
                nn.BatchNorm2d(16),
                nn.ReLU(),
                nn.AdaptiveAvgPool2d(1),
            )
            self.head = nn.Linear(16, 10)

        def forward(self, x):
            return self.head(torch.flatten(self.features(x), 1))

    return with_bn_statistics(TinyCNN(), weight=(0.5, 1.5), bias=(-0.2, 0.2)).eval()


def medium_cnn_module() -> Any:
    """A wider CNN than the tests' (32-64-128 channels at 64x64): enough work to time."""
    import torch

    torch.manual_seed(0)
    nn = torch.nn

    def block(cin: int, cout: int) -> Any:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(), nn.MaxPool2d(2))

    model = nn.Sequential(
        block(3, 32), block(32, 64), block(64, 128), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10)
    )
    return with_bn_statistics(model).eval()


def resnetish_module() -> Any:
    """A small ResNet: stem + 3 stages x 2 basic blocks (16-32-64 channels), BatchNorm with real statistics."""
    import torch

    torch.manual_seed(0)
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.b1 = nn.BatchNorm2d(cout)
            self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.b2 = nn.BatchNorm2d(cout)
            self.skip = (
                nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                if stride != 1 or cin != cout
                else nn.Identity()
            )

        def forward(self, x: Any) -> Any:
            y = torch.relu(self.b1(self.c1(x)))
            return torch.relu(self.b2(self.c2(y)) + self.skip(x))

    layers: list[Any] = [nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU()]
    cin = 16
    for cout, stride in ((16, 1), (32, 2), (64, 2)):
        layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.1), nn.Linear(64, 10)]
    return with_bn_statistics(nn.Sequential(*layers), weight=(0.5, 1.5), bias=(-0.2, 0.2)).eval()


def tiny_transformer_module(d_model: int = 32, heads: int = 4):
    """A transformer encoder block: LayerNorm, attention with Softmax, GELU MLP, residuals."""
    torch = _torch()
    nn = torch.nn

    class EncoderBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(d_model)
            self.qkv = nn.Linear(d_model, 3 * d_model)
            self.proj = nn.Linear(d_model, d_model)
            self.ln2 = nn.LayerNorm(d_model)
            self.fc1 = nn.Linear(d_model, 4 * d_model)
            self.fc2 = nn.Linear(4 * d_model, d_model)
            self.act = nn.GELU()

        def forward(self, x):
            b, t, d = x.shape
            h = self.ln1(x)
            q, k, v = self.qkv(h).chunk(3, dim=-1)
            q = q.reshape(b, t, heads, d // heads).transpose(1, 2)
            k = k.reshape(b, t, heads, d // heads).transpose(1, 2)
            v = v.reshape(b, t, heads, d // heads).transpose(1, 2)
            att = torch.softmax(q @ k.transpose(-2, -1) / (d // heads) ** 0.5, dim=-1)
            y = (att @ v).transpose(1, 2).reshape(b, t, d)
            x = x + self.proj(y)
            return x + self.fc2(self.act(self.fc1(self.ln2(x))))

    return EncoderBlock().eval()


#: Vocabulary of the tiny BERT (token ids are drawn below it).
BERT_VOCAB = 99


def tiny_bert_module():
    """transformers' BertModel from a tiny BertConfig (2 layers, hidden 32, 4 heads), built offline."""
    _torch()  # seeds the weights
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=BERT_VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=64,
    )
    return BertModel(config).eval()


def export_onnx(
    module,
    example,
    path: Path,
    *,
    input_name: str = "input",
    output_name: str = "output",
    dynamic_batch: bool = True,
    opset: int = 17,
) -> Path:
    """Export a torch module to ONNX (TorchScript-based exporter: fast and deterministic)."""
    torch = _torch()
    dynamic_axes = {input_name: {0: "batch"}, output_name: {0: "batch"}} if dynamic_batch else None
    torch.onnx.export(
        module,
        (example,),
        str(path),
        input_names=[input_name],
        output_names=[output_name],
        dynamic_axes=dynamic_axes,
        opset_version=opset,
        dynamo=False,
    )
    return path


def export_unfolded(module: Any, example: Any, path: Path) -> Path:
    """TorchScript export that keeps BatchNorm and constants as the module has them (no exporter folding)."""
    import torch

    torch.onnx.export(
        module,
        (example,),
        str(path),
        input_names=["input"],
        output_names=["output"],
        dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}},
        opset_version=17,
        dynamo=False,
        training=torch.onnx.TrainingMode.PRESERVE,
        do_constant_folding=False,
    )
    return path


def tiny_cnn_onnx(path: Path) -> Path:
    torch = _torch()
    return export_onnx(tiny_cnn_module(), torch.randn(1, 3, 32, 32), path)


def tiny_transformer_onnx(path: Path) -> Path:
    torch = _torch()
    return export_onnx(tiny_transformer_module(), torch.randn(1, 16, 32), path)


def image_calibration(path: Path, n: int = 16, name: str = "input") -> Path:
    rng = np.random.default_rng(7)
    np.savez(path, **{name: rng.standard_normal((n, 3, 32, 32)).astype(np.float32)})
    return path


def export_again(result, spec, store, repository) -> dict[str, dict]:
    """Compile ``result``'s source again with another spec (say, another precision) on the same store.

    The reference and the conversions do not depend on precision, so they must come from the
    cache: only export and publish run again. Returns each target's export meta; a failed
    target raises its error.
    """
    from services.errors import KilnError
    from services.pipeline import compile_model

    again = compile_model(result.source.path, spec, store=store, repository=repository)
    rerun = [
        sid for sid, o in again.steps.items() if not o.cached and again.plan.step(sid).kind not in ("export", "publish")
    ]
    assert not rerun, f"precision-independent steps ran again: {rerun}"
    for t in again.targets.values():
        if t.error:
            raise KilnError.from_dict(t.error)
    return {t.value: again.steps[f"export:{t.value}"].meta for t in spec.targets}


def assert_parity_passed(parity: dict, precision: str, samples: int = 4) -> None:
    """Assert a parity report passed inside the bounds the route tests hold every artifact to, on the
    generated samples a spec with ``validation.samples`` asks for at the first shape (and any at a second).

    Kiln generates at least ``validation.min_unseen_samples`` (default 8) whatever ``samples`` says, so that
    a reduced-precision verdict rests on enough unseen inputs (services/pipeline/reference.py).
    """
    from services.spec import ValidationSpec

    assert parity["passed"], parity["failures"]
    expected = max(samples, ValidationSpec().min_unseen_samples)
    assert parity["samples_per_shape"][0] == expected, (parity["samples_per_shape"], expected)
    assert parity["samples"] == sum(parity["samples_per_shape"])
    bound = {"fp32": 1e-4, "fp16": 2e-2}.get(precision)
    for out in parity["outputs"]:
        if bound is not None:
            assert out["max_abs"] <= bound, out
        assert out["cosine"] >= {"fp32": 0.9999, "fp16": 0.999, "int8": 0.98}[precision], out


def grouped_cnn_onnx(path: Path, groups: int) -> Path:
    """Two Conv layers (the second with ``groups``) and a ReLU, exported from torch: [N,3,16,16] -> [N,8,16,16]."""
    torch = _torch()
    nn = torch.nn
    module = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, groups=groups))
    return export_onnx(module.eval(), torch.randn(1, 3, 16, 16), path)


def matrix_op_onnx(path: Path, op: str, domain: str = "") -> Path:
    """``op(x + W)`` on a batch of 3x3 matrices (W keeps them invertible): a model around one linear-algebra op.

    OpenVINO's ONNX reader has no rule for ``Det`` or ``com.microsoft.Inverse``; onnxruntime
    runs both and onnx2tf converts both, so they exercise Kiln's fallback routes for real.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(0).normal(size=(3, 3)).astype("float32") + 3 * np.eye(3, dtype="float32")
    nodes = [helper.make_node("Add", ["x", "w"], ["a"]), helper.make_node(op, ["a"], ["y"], domain=domain)]
    graph = helper.make_graph(
        nodes,
        "matrix_op",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w")],
    )
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    onnx.save(helper.make_model(graph, opset_imports=opsets), str(path))
    return path


GPT2_VOCAB = 128


def tiny_gpt2_onnx(path: Path, *, n_embd: int = 64, n_layer: int = 2, n_head: int = 4, seq: int = 16) -> Path:
    """transformers' GPT2LMHeadModel from a GPT2Config with random weights, as ONNX: input_ids [N, seq] -> logits.

    Eager attention and an explicit all-ones mask keep the TorchScript exporter away from
    transformers' packed-sequence detection (``torch.diff``, which ONNX has no op for).
    """
    torch = _torch()
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=GPT2_VOCAB,
        n_positions=max(64, seq),
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    config._attn_implementation = "eager"
    lm = GPT2LMHeadModel(config).eval()

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = lm

        def forward(self, input_ids):
            return self.lm(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False).logits

    ids = torch.randint(0, GPT2_VOCAB, (1, seq))
    return export_onnx(Logits().eval(), ids, path, input_name="input_ids", output_name="logits")


#: Different arithmetic per sample rate, as Silero VAD's ``forward(x, sr: int)`` has.
RATE_DEPENDENT_SCRIPT = """
import sys
import torch


class RateDependent(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, sr: int) -> torch.Tensor:
        if sr == 16000:
            return torch.relu(self.lin(x))
        return torch.tanh(self.lin(x)) * 3.0


torch.manual_seed(0)
torch.jit.script(RateDependent().eval()).save(sys.argv[1])
"""


def rate_dependent_torchscript(folder: Path) -> Path:
    """A scripted module ``forward(x: [N, 8], sr: int) -> [N, 4]`` whose arithmetic depends on ``sr``
    (relu at 16000, 3*tanh otherwise), saved as ``folder/rate.pt``.

    Scripted in a fresh interpreter: TorchScript compiles a class once per process, and a test
    session has other scripted modules and state that made in-session scripting of it fail;
    TorchScript also reads the class's source from its file, so the script is written beside it.
    """
    import subprocess
    import sys

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "make_rate.py").write_text(RATE_DEPENDENT_SCRIPT)
    path = folder / "rate.pt"
    subprocess.run([sys.executable, str(folder / "make_rate.py"), str(path)], check=True, timeout=300)
    return path


STATE_UNITS = 16


def _stateful_weights() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    wx = (rng.standard_normal((8, STATE_UNITS)) / np.sqrt(8)).astype(np.float32)
    wy = (rng.standard_normal((STATE_UNITS, 1)) / np.sqrt(STATE_UNITS)).astype(np.float32)
    return wx, wy


def stateful_scalar_step(x: np.ndarray, state: np.ndarray, sr: Any) -> dict[str, np.ndarray]:
    """``stateful_scalar_onnx``'s outputs for one feed, computed in numpy."""
    wx, wy = _stateful_weights()
    scale = np.float32(np.asarray(sr)) / np.float32(16000.0)
    new_state = np.tanh((state + (x @ wx)[None]) * scale).astype(np.float32)
    y = (1.0 / (1.0 + np.exp(-(new_state.mean(axis=0) @ wy)))).astype(np.float32)
    return {"y": y, "new_state": new_state}


def stateful_scalar_onnx(path: Path) -> Path:
    """A streaming cell shaped like Silero VAD's: ``x [B, 8]``, ``state [2, B, 16]`` (batch on axis 1)
    and a 0-d int64 ``sr`` in; ``y [B, 1]`` and ``new_state [2, B, 16]`` out.

    ``new_state = tanh((state + x @ Wx) * sr / 16000)`` and ``y = sigmoid(mean(new_state, 0) @ Wy)``:
    the rate scales every value, so a wrong ``sr`` changes the outputs. No array of such samples
    stacks on axis 0; calibration data for it uses the whole-feed layout (``<sample>/<input>``).
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    wx, wy = _stateful_weights()
    nodes = [
        helper.make_node("MatMul", ["x", "wx"], ["xw"]),
        helper.make_node("Unsqueeze", ["xw", "axis0"], ["xw1"]),
        helper.make_node("Add", ["state", "xw1"], ["summed"]),
        helper.make_node("Cast", ["sr"], ["srf"], to=TensorProto.FLOAT),
        helper.make_node("Div", ["srf", "base_rate"], ["scale"]),
        helper.make_node("Mul", ["summed", "scale"], ["scaled"]),
        helper.make_node("Tanh", ["scaled"], ["new_state"]),
        helper.make_node("ReduceMean", ["new_state", "axis0"], ["pooled"], keepdims=0),
        helper.make_node("MatMul", ["pooled", "wy"], ["logit"]),
        helper.make_node("Sigmoid", ["logit"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "stateful_scalar",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 8]),
            helper.make_tensor_value_info("state", TensorProto.FLOAT, [2, "B", STATE_UNITS]),
            helper.make_tensor_value_info("sr", TensorProto.INT64, []),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 1]),
            helper.make_tensor_value_info("new_state", TensorProto.FLOAT, [2, "B", STATE_UNITS]),
        ],
        [
            numpy_helper.from_array(wx, "wx"),
            numpy_helper.from_array(wy, "wy"),
            numpy_helper.from_array(np.array([0], np.int64), "axis0"),
            numpy_helper.from_array(np.array(16000.0, np.float32), "base_rate"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def stateful_scalar_feeds(n: int, batch: int = 1, rate: int = 16000, seed: int = 5) -> dict[str, np.ndarray]:
    """``n`` whole feeds for ``stateful_scalar_onnx`` keyed ``<sample>/<input>``: the state carried
    from step to step as a stream carries it, and the same 0-d int64 ``sr`` in every one."""
    rng = np.random.default_rng(seed)
    state = np.zeros((2, batch, STATE_UNITS), np.float32)
    feeds: dict[str, np.ndarray] = {}
    for i in range(n):
        x = rng.standard_normal((batch, 8)).astype(np.float32)
        feeds[f"{i}/x"], feeds[f"{i}/state"], feeds[f"{i}/sr"] = x, state, np.array(rate, np.int64)
        state = stateful_scalar_step(x, state, rate)["new_state"]
    return feeds
