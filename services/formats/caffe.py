"""Caffe models (deploy ``.prototxt`` + trained ``.caffemodel``), read as data.

No Caffe framework installs from PyPI, and Kiln would not run one on untrusted input anyway:
both files are protobuf messages of BVLC Caffe's ``caffe.NetParameter``. This module declares
the part of ``caffe.proto`` that inference nets use (same field numbers, so any caffemodel
parses; fields outside it are kept as unknown fields and ignored), parses the two files with
size limits, and vets them before anything else reads them:

- each file has a size cap, and the binary parse runs under protobuf's recursion limit;
- a ``Python`` layer (code that Caffe would import and run), in any phase and in either file,
  is refused with UNSAFE_INPUT;
- every weight blob's element count must match its declared shape, and the weights are
  capped in total, so a crafted file cannot make the converter allocate without bound;
- training-only layers (data readers, losses) are refused with a hint to upload the deploy net.

:func:`load_caffe_net` returns the network the deploy prototxt describes, in TEST phase, with
each layer's weights taken from the caffemodel's layer of the same name (as Caffe's
``CopyTrainedLayersFrom`` does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from services.errors import SourceUnreadable, UnsafeInput, UnsupportedFormat

__all__ = [
    "CAFFEMODEL_SUFFIX",
    "PROTOTXT_SUFFIXES",
    "CaffeBlob",
    "CaffeLayer",
    "CaffeLimits",
    "CaffeNet",
    "caffe_members_kind",
    "caffe_messages",
    "find_caffe_files",
    "load_caffe_net",
    "looks_like_prototxt",
    "sniff_caffe",
    "vet_caffe_source",
    "vetted_caffe_root",
]

PROTOTXT_SUFFIXES = (".prototxt", ".pbtxt")
CAFFEMODEL_SUFFIX = ".caffemodel"

#: Layers that only exist for training or data input; a deploy net has none of them.
TRAINING_LAYERS = frozenset(
    {
        "Data",
        "ImageData",
        "HDF5Data",
        "HDF5Output",
        "MemoryData",
        "WindowData",
        "DummyData",
        "Accuracy",
        "SoftmaxWithLoss",
        "EuclideanLoss",
        "HingeLoss",
        "InfogainLoss",
        "MultinomialLogisticLoss",
        "SigmoidCrossEntropyLoss",
        "ContrastiveLoss",
    }
)


@dataclass(frozen=True)
class CaffeLimits:
    """Caps applied before and while parsing; the defaults fit every published Caffe model."""

    max_prototxt_bytes: int = 8 << 20
    max_caffemodel_bytes: int = 2 << 30  # protobuf's own message limit
    max_layers: int = 10_000
    max_weight_elements: int = 1 << 29  # 2 GiB of float32
    max_blob_rank: int = 8


# --- the schema: the inference subset of BVLC caffe.proto (proto2), field numbers as upstream ---

_O, _R = "optional", "repeated"
# (field name, number, label, type, message/enum type name or None, default or None, packed)
_FieldDecl = tuple[str, int, str, str, str | None, Any, bool]


def _f(name: str, num: int, typ: str, label: str = _O, ref: str | None = None, default: Any = None) -> _FieldDecl:
    return (name, num, label, typ, ref, default, False)


def _p(name: str, num: int, typ: str) -> _FieldDecl:
    return (name, num, _R, typ, None, None, True)


_MESSAGES: dict[str, list[_FieldDecl]] = {
    "BlobShape": [_p("dim", 1, "int64")],
    "BlobProto": [
        _f("shape", 7, "message", ref="BlobShape"),
        _p("data", 5, "float"),
        _p("diff", 6, "float"),
        _p("double_data", 8, "double"),
        _p("double_diff", 9, "double"),
        _f("num", 1, "int32", default=0),
        _f("channels", 2, "int32", default=0),
        _f("height", 3, "int32", default=0),
        _f("width", 4, "int32", default=0),
    ],
    "NetStateRule": [
        _f("phase", 1, "enum", ref="Phase"),
        _f("min_level", 2, "int32"),
        _f("max_level", 3, "int32"),
        _f("stage", 4, "string", _R),
        _f("not_stage", 5, "string", _R),
    ],
    "NetParameter": [
        _f("name", 1, "string"),
        _f("input", 3, "string", _R),
        _f("input_shape", 8, "message", _R, "BlobShape"),
        _f("input_dim", 4, "int32", _R),
        _f("force_backward", 5, "bool"),
        _f("debug_info", 7, "bool"),
        _f("layer", 100, "message", _R, "LayerParameter"),
        # V1LayerParameter (`layers`, pre-2015 nets) is read only far enough to name it.
        _f("layers", 2, "message", _R, "V1LayerParameter"),
    ],
    "V1LayerParameter": [_f("name", 4, "string")],
    "ParamSpec": [_f("name", 1, "string"), _f("lr_mult", 3, "float"), _f("decay_mult", 4, "float")],
    "LayerParameter": [
        _f("name", 1, "string"),
        _f("type", 2, "string"),
        _f("bottom", 3, "string", _R),
        _f("top", 4, "string", _R),
        _f("phase", 10, "enum", ref="Phase"),
        _f("loss_weight", 5, "float", _R),
        _f("param", 6, "message", _R, "ParamSpec"),
        _f("blobs", 7, "message", _R, "BlobProto"),
        _f("propagate_down", 11, "bool", _R),
        _f("include", 8, "message", _R, "NetStateRule"),
        _f("exclude", 9, "message", _R, "NetStateRule"),
        _f("batch_norm_param", 139, "message", ref="BatchNormParameter"),
        _f("bias_param", 141, "message", ref="BiasParameter"),
        _f("concat_param", 104, "message", ref="ConcatParameter"),
        _f("convolution_param", 106, "message", ref="ConvolutionParameter"),
        _f("dropout_param", 108, "message", ref="DropoutParameter"),
        _f("eltwise_param", 110, "message", ref="EltwiseParameter"),
        _f("elu_param", 140, "message", ref="ELUParameter"),
        _f("flatten_param", 135, "message", ref="FlattenParameter"),
        _f("inner_product_param", 117, "message", ref="InnerProductParameter"),
        _f("input_param", 143, "message", ref="InputParameter"),
        _f("lrn_param", 118, "message", ref="LRNParameter"),
        _f("pooling_param", 121, "message", ref="PoolingParameter"),
        _f("power_param", 122, "message", ref="PowerParameter"),
        _f("prelu_param", 131, "message", ref="PReLUParameter"),
        _f("python_param", 130, "message", ref="PythonParameter"),
        _f("relu_param", 123, "message", ref="ReLUParameter"),
        _f("reshape_param", 133, "message", ref="ReshapeParameter"),
        _f("scale_param", 142, "message", ref="ScaleParameter"),
        _f("slice_param", 126, "message", ref="SliceParameter"),
        _f("softmax_param", 125, "message", ref="SoftmaxParameter"),
    ],
    "BatchNormParameter": [
        _f("use_global_stats", 1, "bool"),
        _f("moving_average_fraction", 2, "float", default=0.999),
        _f("eps", 3, "float", default=1e-5),
    ],
    "BiasParameter": [_f("axis", 1, "int32", default=1), _f("num_axes", 2, "int32", default=1)],
    "ConcatParameter": [_f("axis", 2, "int32", default=1), _f("concat_dim", 1, "uint32", default=1)],
    "ConvolutionParameter": [
        _f("num_output", 1, "uint32"),
        _f("bias_term", 2, "bool", default=True),
        _f("pad", 3, "uint32", _R),
        _f("kernel_size", 4, "uint32", _R),
        _f("stride", 6, "uint32", _R),
        _f("dilation", 18, "uint32", _R),
        _f("pad_h", 9, "uint32", default=0),
        _f("pad_w", 10, "uint32", default=0),
        _f("kernel_h", 11, "uint32"),
        _f("kernel_w", 12, "uint32"),
        _f("stride_h", 13, "uint32"),
        _f("stride_w", 14, "uint32"),
        _f("group", 5, "uint32", default=1),
        _f("axis", 16, "int32", default=1),
    ],
    "DropoutParameter": [_f("dropout_ratio", 1, "float", default=0.5)],
    "EltwiseParameter": [
        _f("operation", 1, "enum", ref="EltwiseParameter.EltwiseOp", default=1),
        _f("coeff", 2, "float", _R),
    ],
    "ELUParameter": [_f("alpha", 1, "float", default=1.0)],
    "FlattenParameter": [_f("axis", 1, "int32", default=1), _f("end_axis", 2, "int32", default=-1)],
    "InnerProductParameter": [
        _f("num_output", 1, "uint32"),
        _f("bias_term", 2, "bool", default=True),
        _f("axis", 5, "int32", default=1),
        _f("transpose", 6, "bool", default=False),
    ],
    "InputParameter": [_f("shape", 1, "message", _R, "BlobShape")],
    "LRNParameter": [
        _f("local_size", 1, "uint32", default=5),
        _f("alpha", 2, "float", default=1.0),
        _f("beta", 3, "float", default=0.75),
        _f("norm_region", 4, "enum", ref="LRNParameter.NormRegion", default=0),
        _f("k", 5, "float", default=1.0),
    ],
    "PoolingParameter": [
        _f("pool", 1, "enum", ref="PoolingParameter.PoolMethod", default=0),
        _f("pad", 4, "uint32", default=0),
        _f("pad_h", 9, "uint32", default=0),
        _f("pad_w", 10, "uint32", default=0),
        _f("kernel_size", 2, "uint32"),
        _f("kernel_h", 5, "uint32"),
        _f("kernel_w", 6, "uint32"),
        _f("stride", 3, "uint32", default=1),
        _f("stride_h", 7, "uint32"),
        _f("stride_w", 8, "uint32"),
        _f("global_pooling", 12, "bool", default=False),
    ],
    "PowerParameter": [
        _f("power", 1, "float", default=1.0),
        _f("scale", 2, "float", default=1.0),
        _f("shift", 3, "float", default=0.0),
    ],
    "PReLUParameter": [_f("channel_shared", 2, "bool", default=False)],
    "PythonParameter": [_f("module", 1, "string"), _f("layer", 2, "string"), _f("param_str", 3, "string")],
    "ReLUParameter": [_f("negative_slope", 1, "float", default=0.0)],
    "ReshapeParameter": [
        _f("shape", 1, "message", ref="BlobShape"),
        _f("axis", 2, "int32", default=0),
        _f("num_axes", 3, "int32", default=-1),
    ],
    "ScaleParameter": [
        _f("axis", 1, "int32", default=1),
        _f("num_axes", 2, "int32", default=1),
        _f("bias_term", 4, "bool", default=False),
    ],
    "SliceParameter": [
        _f("axis", 3, "int32", default=1),
        _f("slice_point", 2, "uint32", _R),
        _f("slice_dim", 1, "uint32", default=1),
    ],
    "SoftmaxParameter": [_f("axis", 2, "int32", default=1)],
}

_ENUMS: dict[str, list[tuple[str, int]]] = {
    "Phase": [("TRAIN", 0), ("TEST", 1)],
    "EltwiseParameter.EltwiseOp": [("PROD", 0), ("SUM", 1), ("MAX", 2)],
    "LRNParameter.NormRegion": [("ACROSS_CHANNELS", 0), ("WITHIN_CHANNEL", 1)],
    "PoolingParameter.PoolMethod": [("MAX", 0), ("AVE", 1), ("STOCHASTIC", 2)],
}


@cache
def caffe_messages() -> dict[str, Any]:
    """Return the message classes of Kiln's ``caffe.proto`` subset, keyed by name (``NetParameter``, ...)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    fdp = descriptor_pb2.FileDescriptorProto(name="kiln_caffe.proto", package="caffe", syntax="proto2")
    fd = descriptor_pb2.FieldDescriptorProto
    types = {
        "int32": fd.TYPE_INT32,
        "int64": fd.TYPE_INT64,
        "uint32": fd.TYPE_UINT32,
        "float": fd.TYPE_FLOAT,
        "double": fd.TYPE_DOUBLE,
        "bool": fd.TYPE_BOOL,
        "string": fd.TYPE_STRING,
        "message": fd.TYPE_MESSAGE,
        "enum": fd.TYPE_ENUM,
    }
    msgs: dict[str, Any] = {}
    for name, fields in _MESSAGES.items():
        m = fdp.message_type.add(name=name)
        msgs[name] = m
        for fname, num, label, typ, ref, default, packed in fields:
            f = m.field.add(name=fname, number=num, type=types[typ])
            f.label = fd.LABEL_REPEATED if label == _R else fd.LABEL_OPTIONAL
            if ref is not None:
                f.type_name = ".caffe." + ref
            if default is not None:
                if typ == "enum":
                    enum_values = dict((v, k) for k, v in _ENUMS[ref or ""])
                    f.default_value = enum_values[default]
                elif typ == "bool":
                    f.default_value = "true" if default else "false"
                else:
                    f.default_value = repr(default) if typ in ("float", "double") else str(default)
            if packed:
                f.options.packed = True
    for full, values in _ENUMS.items():
        owner, _, enum_name = full.rpartition(".")
        target = msgs[owner].enum_type if owner else fdp.enum_type
        e = target.add(name=enum_name)
        for vname, number in values:
            e.value.add(name=vname, number=number)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName("caffe." + name)) for name in _MESSAGES}


# --- the loaded network ---


@dataclass
class CaffeBlob:
    """A weight blob: its array (float32) in the blob's declared shape."""

    array: np.ndarray


@dataclass
class CaffeLayer:
    """One layer of the deploy net, with its parameter message and trained weights."""

    name: str
    type: str
    bottoms: list[str]
    tops: list[str]
    param: Any  # the LayerParameter message (prototxt), for the layer's *_param fields
    blobs: list[np.ndarray] = field(default_factory=list)


@dataclass
class CaffeNet:
    """A deploy net: its inputs (name -> shape), layers in order, and output blob names."""

    name: str
    inputs: dict[str, list[int]]
    layers: list[CaffeLayer]
    outputs: list[str]
    prototxt: Path
    caffemodel: Path


def looks_like_prototxt(head: bytes) -> bool:
    """Return True when ``head`` reads as a Caffe net in protobuf text format."""
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return False
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    if not lines:
        return False
    starts = ("name:", "layer {", "layer{", "layers {", "layers{", "input:", "input_shape", "input_dim:")
    return lines[0].startswith(starts) and ("layer" in text or "input" in text)


def sniff_caffe(path: Path) -> str | None:
    """Return what detection saw when ``path`` is a directory holding a Caffe model, else None.

    A lone ``.caffemodel`` or deploy prototxt is one half of a model: UNSUPPORTED_FORMAT with a hint.
    """
    if path.is_dir():
        return "directory with a Caffe .prototxt and .caffemodel" if find_caffe_files(path) is not None else None
    with open(path, "rb") as f:
        head = f.read(4096)
    if path.suffix == CAFFEMODEL_SUFFIX or looks_like_prototxt(head):
        half = "weights" if path.suffix == CAFFEMODEL_SUFFIX else "net definition"
        raise UnsupportedFormat(
            f"{path.name} is one half of a Caffe model ({half})",
            hint="Upload the deploy .prototxt and the .caffemodel together, in a .zip or .tar.gz.",
        )
    return None


def caffe_members_kind(members: list[str]) -> str | None:
    """Return what detection saw when archive ``members`` hold a Caffe model (one .caffemodel and a prototxt), else None."""
    models = [m for m in members if m.endswith(CAFFEMODEL_SUFFIX)]
    protos = [m for m in members if m.endswith(PROTOTXT_SUFFIXES)]
    if len(models) == 1 and protos:
        return f"archive holding a Caffe net ({protos[0].rsplit('/', 1)[-1]}, {models[0].rsplit('/', 1)[-1]})"
    return None


def find_caffe_files(root: Path) -> tuple[Path, Path] | None:
    """Return (prototxt, caffemodel) when ``root`` (a directory, searched recursively) holds exactly one of each."""
    if not root.is_dir():
        return None
    models = sorted(p for p in root.rglob("*" + CAFFEMODEL_SUFFIX) if p.is_file())
    protos = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in PROTOTXT_SUFFIXES)
    if len(models) != 1 or not protos:
        return None
    if len(protos) > 1:
        # Model zoos ship train_val and solver files beside the deploy net: take the one named deploy.
        deploy = [p for p in protos if "deploy" in p.name]
        if len(deploy) != 1:
            raise UnsupportedFormat(
                f"{len(protos)} prototxt files beside {models[0].name}: {[p.name for p in protos][:6]}",
                hint="Upload only the deploy .prototxt with the .caffemodel (or name it *deploy*.prototxt).",
            )
        protos = deploy
    return protos[0], models[0]


def _check_size(path: Path, cap: int, what: str) -> None:
    size = path.stat().st_size
    if size > cap:
        raise UnsafeInput(
            f"{path.name} is {size} bytes; Kiln reads {what} files up to {cap} bytes",
            hint="A Caffe model this large is outside what Kiln vets; split or prune it.",
        )
    if size == 0:
        raise SourceUnreadable(f"{path.name} is empty")


def _parse_prototxt(path: Path, limits: CaffeLimits) -> Any:
    from google.protobuf import text_format

    _check_size(path, limits.max_prototxt_bytes, "prototxt")
    net = caffe_messages()["NetParameter"]()
    try:
        text = path.read_text("utf-8")
        # Layer parameters outside Kiln's schema (forks' extras, training settings) are skipped,
        # not refused; the converter refuses layer *types* it cannot convert, by name.
        text_format.Parse(text, net, allow_unknown_field=True, allow_unknown_extension=True)
    except RecursionError as exc:
        raise UnsafeInput(f"{path.name} nests deeper than a Caffe net does", hint="This is not a Caffe net.") from exc
    except (UnicodeDecodeError, text_format.ParseError) as exc:
        raise SourceUnreadable(
            f"{path.name} is not a Caffe net in protobuf text format: {str(exc)[:300]}",
            hint="Upload the deploy .prototxt the model was published with.",
        ) from exc
    return net


def _parse_caffemodel(path: Path, limits: CaffeLimits) -> Any:
    from google.protobuf.message import DecodeError

    _check_size(path, limits.max_caffemodel_bytes, "caffemodel")
    net = caffe_messages()["NetParameter"]()
    try:
        # upb's decoder caps nesting (100 levels) and bounds-checks every length prefix.
        net.ParseFromString(path.read_bytes())
    except (DecodeError, RecursionError) as exc:
        raise SourceUnreadable(
            f"{path.name} is not a binary caffe.NetParameter: {str(exc)[:300]}",
            hint="Upload the trained .caffemodel (binary), not a text or HDF5 snapshot.",
        ) from exc
    return net


def _blob_array(blob: Any, layer: str, limits: CaffeLimits) -> np.ndarray:
    if blob.HasField("shape"):
        shape = [int(d) for d in blob.shape.dim]
    else:  # legacy 4-D num/channels/height/width
        shape = [int(blob.num), int(blob.channels), int(blob.height), int(blob.width)]
    if len(shape) > limits.max_blob_rank or any(d < 0 for d in shape):
        raise UnsafeInput(f"layer {layer!r} has a weight blob of shape {shape}")
    values = blob.data if len(blob.data) else blob.double_data
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if count != len(values):
        raise SourceUnreadable(
            f"layer {layer!r}: weight blob declares shape {shape} ({count} values) but holds {len(values)}",
            hint="The caffemodel is truncated or corrupt.",
        )
    return np.asarray(values, dtype=np.float32).reshape(shape)


def _in_test_phase(layer: Any) -> bool:
    test = 1
    if len(layer.include):
        return any(not r.HasField("phase") or r.phase == test for r in layer.include)
    if len(layer.exclude):
        return not any(r.HasField("phase") and r.phase == test for r in layer.exclude)
    return True


def _net_inputs(net: Any) -> dict[str, list[int]]:
    inputs: dict[str, list[int]] = {}
    names = list(net.input)
    for i, name in enumerate(names):
        if i < len(net.input_shape):
            inputs[name] = [int(d) for d in net.input_shape[i].dim]
        elif len(net.input_dim) >= 4 * (i + 1):
            inputs[name] = [int(d) for d in net.input_dim[4 * i : 4 * i + 4]]
        else:
            raise SourceUnreadable(f"net input {name!r} has no shape", hint="Give it input_shape in the prototxt.")
    return inputs


def _outputs(inputs: dict[str, list[int]], layers: list[CaffeLayer]) -> list[str]:
    """Return the blobs the net produces that no later layer reads, in the order they are last written."""
    pending: dict[str, int] = {}
    for i, layer in enumerate(layers):
        for b in layer.bottoms:
            pending.pop(b, None)
        for t in layer.tops:
            pending[t] = i
    return [b for b, _ in sorted(pending.items(), key=lambda kv: kv[1]) if b not in inputs]


def _check_layer_types(layers: Any, where: str) -> None:
    """Refuse Python layers in every phase: a TRAIN-only one is as much code as a TEST one, and a
    tool that ignores phases (or a later edit of the rules) would reach it."""
    for lp in layers:
        if lp.type == "Python":
            raise UnsafeInput(
                f"layer {lp.name!r} in {where} is a Python layer: Caffe would import and run module "
                f"{lp.python_param.module!r}; Kiln never runs code from a model",
                hint="Replace the Python layer with built-in layers before uploading.",
            )


def vet_caffe_source(root: Path, limits: CaffeLimits | None = None) -> None:
    """Vet a Caffe upload cheaply, at submission: file sizes, and the deploy prototxt parsed and checked.

    The caffemodel's weights are read by the steps (:func:`load_caffe_net`); here only its size.
    """
    limits = limits or CaffeLimits()
    found = find_caffe_files(root)
    if found is None:
        raise SourceUnreadable(
            f"{root.name} does not hold one .prototxt and one .caffemodel",
            hint="Upload the deploy .prototxt and the .caffemodel together, in a .zip or .tar.gz.",
        )
    proto_path, model_path = found
    _check_size(model_path, limits.max_caffemodel_bytes, "caffemodel")
    deploy = _parse_prototxt(proto_path, limits)
    if len(deploy.layers):
        raise UnsupportedFormat(
            f"{proto_path.name} uses Caffe's V1 `layers` format (before 2015)",
            hint="Upgrade it with Caffe's upgrade_net_proto_text tool first.",
        )
    if len(deploy.layer) > limits.max_layers:
        raise UnsafeInput(f"{proto_path.name} has {len(deploy.layer)} layers; Kiln reads up to {limits.max_layers}")
    _check_layer_types(deploy.layer, proto_path.name)


def vetted_caffe_root(root: Path) -> Path:
    """Return ``root`` (the directory the Caffe loaders open) once :func:`vet_caffe_source` accepts it."""
    vet_caffe_source(root)
    return root


def load_caffe_net(root: Path, limits: CaffeLimits | None = None) -> CaffeNet:
    """Return the vetted deploy net in ``root`` (a directory holding the .prototxt and .caffemodel)."""
    limits = limits or CaffeLimits()
    found = find_caffe_files(root)
    if found is None:
        raise SourceUnreadable(
            f"{root.name} does not hold one .prototxt and one .caffemodel",
            hint="Upload the deploy .prototxt and the .caffemodel together, in a .zip or .tar.gz.",
        )
    proto_path, model_path = found
    deploy = _parse_prototxt(proto_path, limits)
    trained = _parse_caffemodel(model_path, limits)
    if len(deploy.layers) or (not len(deploy.layer) and len(trained.layers)):
        raise UnsupportedFormat(
            f"{proto_path.name if len(deploy.layers) else model_path.name} uses Caffe's V1 `layers` format (before 2015)",
            hint="Upgrade it with Caffe's upgrade_net_proto_text / upgrade_net_proto_binary tools first.",
        )
    if len(deploy.layer) > limits.max_layers:
        raise UnsafeInput(f"{proto_path.name} has {len(deploy.layer)} layers; Kiln reads up to {limits.max_layers}")
    _check_layer_types(trained.layer, model_path.name)
    weights: dict[str, Any] = {}
    for tl in trained.layer:
        if len(tl.blobs):
            weights[tl.name] = tl.blobs
    inputs = _net_inputs(deploy)
    layers: list[CaffeLayer] = []
    total = 0
    for lp in deploy.layer:
        if not _in_test_phase(lp):
            continue
        _check_layer_types([lp], proto_path.name)
        if lp.type in TRAINING_LAYERS:
            raise UnsupportedFormat(
                f"{proto_path.name} is a training net: layer {lp.name!r} is a {lp.type} layer",
                hint="Upload the deploy prototxt (Input layer or input_shape, no data or loss layers).",
            )
        if lp.type == "Input":
            shapes = [[int(d) for d in s.dim] for s in lp.input_param.shape]
            for i, top in enumerate(lp.top):
                if not shapes:
                    raise SourceUnreadable(f"Input layer {lp.name!r} gives no shape", hint="Add input_param { shape }.")
                inputs[top] = shapes[min(i, len(shapes) - 1)]
            continue
        blobs = []
        for blob in weights.get(lp.name, lp.blobs):
            arr = _blob_array(blob, lp.name, limits)
            total += arr.size
            if total > limits.max_weight_elements:
                raise UnsafeInput(f"{model_path.name} holds more than {limits.max_weight_elements} weights")
            blobs.append(arr)
        layers.append(CaffeLayer(lp.name, lp.type, list(lp.bottom), list(lp.top), lp, blobs))
    if not inputs:
        raise SourceUnreadable(
            f"{proto_path.name} declares no input",
            hint="A deploy prototxt starts with an Input layer (input_param { shape { dim: ... } }) or input/input_shape.",
        )
    for name, shape in inputs.items():
        if not shape or any(d <= 0 for d in shape):
            raise SourceUnreadable(f"input {name!r} has shape {shape}", hint="Give every input a positive shape.")
    outputs = _outputs(inputs, layers)
    if not outputs:
        raise SourceUnreadable(f"{proto_path.name} produces no output blob")
    return CaffeNet(deploy.name or proto_path.stem, inputs, layers, outputs, proto_path, model_path)
