"""Which ONNX operators and tensor types TensorRT's ONNX parser imports, per TensorRT major version.

This module is data, not logic: :mod:`services.tensorrt.preflight` reads it.

Where it comes from
-------------------
* TensorRT 10.x: the "Operator Support Matrix" in ``docs/operators.md`` of
  github.com/onnx/onnx-tensorrt, the revision headed "TensorRT 10.15 supports operators in the
  inclusive range of opset 9 to opset 24" (10.15 GA, 2026-02). Rows marked ``Y`` are in
  ``supported``, rows marked ``N`` in ``listed_unsupported``; the Restrictions column is what
  :mod:`services.tensorrt.restrictions` checks statically.
* TensorRT 11.x: onnx-tensorrt had not published an 11.x matrix in the copies we could read.
  The table is the 10.15 one plus the parser changes the TensorRT 11.0–11.5 release notes list:
  ``Swish`` (11.0), ``DFT`` through the cuFFT plugin and 5-D ``GridSample`` (11.2), ``Squeeze``
  without axes (11.5), opset 25 and ONNX 1.22 (11.5). The 11.x custom ops (``TRT_Attention``,
  ``TRT_MoE``, ``TRT_KVCacheUpdate``) live in the ``trt`` domain and are listed separately.

When a new matrix is published, update the table here and its ``describes`` field; the
tests pin a few rows so a careless edit shows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["PARSER_SUPPORT", "ParserSupport", "parser_support"]


@dataclass(frozen=True)
class ParserSupport:
    """What one TensorRT release's ONNX parser imports."""

    describes: str  # the TensorRT release the table was taken from
    source: str  # where the table was read
    opset_min: int
    opset_max: int
    supported: frozenset[str]
    listed_unsupported: frozenset[str]  # rows marked N; anything not in `supported` is refused as well
    # ONNX TensorProto.DataType names the parser accepts (DOUBLE is cast down with a warning).
    tensor_types: frozenset[str]
    io_only_types: frozenset[str] = frozenset({"UINT8"})  # allowed on network inputs/outputs only
    # Quantized types a DequantizeLinear may read / a QuantizeLinear may write ("Quantized Types").
    quantized_types: frozenset[str] = frozenset({"INT8", "FLOAT8E4M3FN", "INT4", "FLOAT4E2M1"})
    custom_domain_ops: frozenset[tuple[str, str]] = frozenset()  # (domain, op) the parser imports natively
    gridsample_ranks: frozenset[int] = frozenset({4})
    squeeze_without_axes: bool = False
    notes: dict[str, str] = field(default_factory=dict)


# --- TensorRT 10.15 (onnx-tensorrt docs/operators.md), rows marked Y -------------------------
_SUPPORTED_10 = frozenset(
    """
    Abs Acos Acosh Add And ArgMax ArgMin Asin Asinh Atan Atanh Attention AveragePool
    BatchNormalization BlackmanWindow Cast CastLike Ceil Celu Clip Concat Constant ConstantOfShape
    Conv ConvTranspose Cos Cosh CumSum DeformConv DepthToSpace DequantizeLinear Div Dropout Einsum
    Elu Equal Erf Exp Expand EyeLike Flatten Floor Gather GatherElements GatherND Gelu Gemm
    GlobalAveragePool GlobalLpPool GlobalMaxPool Greater GreaterOrEqual GridSample
    GroupNormalization GRU HammingWindow HannWindow HardSigmoid HardSwish Hardmax Identity If
    ImageScaler InstanceNormalization IsInf IsNaN LayerNormalization LeakyRelu Less LessOrEqual Log
    LogSoftmax Loop LRN LSTM LpNormalization LpPool MatMul Max MaxPool Mean
    MeanVarianceNormalization Min Mish Mod Mul Neg NonMaxSuppression NonZero Not OneHot Or Pad
    ParametricSoftplus Pow PRelu QuantizeLinear RandomNormal RandomNormalLike RandomUniform
    RandomUniformLike Range Reciprocal ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax
    ReduceMean ReduceMin ReduceProd ReduceSum ReduceSumSquare Relu Reshape Resize ReverseSequence
    RMSNormalization RNN RoiAlign RotaryEmbedding Round STFT ScaledTanh Scan Scatter
    ScatterElements ScatterND Selu Shape Shrink Sigmoid Sign Sin Sinh Size Slice Softmax Softplus
    Softsign SpaceToDepth Split Sqrt Squeeze Sub Sum Tan Tanh TensorScatter ThresholdedRelu Tile
    TopK Transpose Trilu Unsqueeze Upsample Where Xor
    """.split()
)

# Rows marked N in the same table.
_LISTED_UNSUPPORTED_10 = frozenset(
    """
    AffineGrid Bernoulli BitShift BitwiseAnd BitwiseNot BitwiseOr BitwiseXor Col2Im CenterCropPad
    Compress ConcatFromSequence ConvInteger DFT Det DynamicQuantizeLinear ImageDecoder
    MatMulInteger MaxRoiPool MaxUnpool MelWeightMatrix Multinomial NegativeLogLikelihoodLoss
    Optional OptionalGetElement OptionalHasElement QLinearConv QLinearMatMul RegexFullMatch
    SequenceAt SequenceConstruct SequenceEmpty SequenceErase SequenceInsert SequenceLength
    SequenceMap SoftmaxCrossEntropyLoss SplitToSequence StringConcat StringNormalizer StringSplit
    TfIdfVectorizer Unique
    """.split()
)

# "TensorRT supports the following ONNX data types: DOUBLE, FLOAT32, FLOAT16, BFLOAT16, FP8, FP4,
# INT32, INT64, INT8, INT4, UINT8, and BOOL" (as TensorProto.DataType names).
_TYPES_10 = frozenset(
    {
        "DOUBLE",
        "FLOAT",
        "FLOAT16",
        "BFLOAT16",
        "FLOAT8E4M3FN",
        "FLOAT4E2M1",
        "INT32",
        "INT64",
        "INT8",
        "INT4",
        "UINT8",
        "BOOL",
    }
)

_NOTES = {
    "DOUBLE": "TensorRT casts DOUBLE down to FLOAT, clamping to ±FLT_MAX",
    "quantized": "INT8, INT4, FP8 and FP4 exist only through Q/DQ quantization from a wider float type",
}

TENSORRT_10 = ParserSupport(
    describes="10.15",
    source="github.com/onnx/onnx-tensorrt docs/operators.md (TensorRT 10.15, opset 9-24)",
    opset_min=9,
    opset_max=24,
    supported=_SUPPORTED_10,
    listed_unsupported=_LISTED_UNSUPPORTED_10,
    tensor_types=_TYPES_10,
    notes=_NOTES,
)

TENSORRT_11 = ParserSupport(
    describes="11.5",
    source=(
        "onnx-tensorrt docs/operators.md for 10.15 plus the TensorRT 11.0-11.5 release notes "
        "(Swish 11.0, DFT and 5-D GridSample 11.2, Squeeze without axes and opset 25 in 11.5)"
    ),
    opset_min=9,
    opset_max=25,
    supported=_SUPPORTED_10 | {"Swish", "DFT"},
    listed_unsupported=_LISTED_UNSUPPORTED_10 - {"DFT"},
    tensor_types=_TYPES_10,
    custom_domain_ops=frozenset({("trt", "TRT_Attention"), ("trt", "TRT_MoE"), ("trt", "TRT_KVCacheUpdate")}),
    gridsample_ranks=frozenset({4, 5}),
    squeeze_without_axes=True,
    notes=_NOTES,
)

PARSER_SUPPORT: dict[int, ParserSupport] = {10: TENSORRT_10, 11: TENSORRT_11}


def parser_support(major: int) -> ParserSupport:
    """Return the parser table of a TensorRT major version (10 or 11); KeyError names the known ones."""
    try:
        return PARSER_SUPPORT[major]
    except KeyError:
        known = ", ".join(f"{m}.x" for m in sorted(PARSER_SUPPORT))
        raise KeyError(f"no ONNX parser table for TensorRT {major}.x; known: {known}") from None
