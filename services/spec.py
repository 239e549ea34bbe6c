"""CompileSpec: what a user asks Kiln to build, and its JSON Schema.

The pydantic model is the only description of the spec: the CLI reads it from --spec,
the API reuses it for `POST /compile`, and `kiln schema` prints the generated JSON Schema.
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from services.descriptors import option_sections, registry
from services.errors import InvalidSpec
from services.formats import Format

__all__ = [
    "DEFAULT_TOLERANCES",
    "MAX_INPUT_BYTES",
    "BenchmarkSpec",
    "CompileSpec",
    "EvaluationMetric",
    "EvaluationSpec",
    "InputSpec",
    "NotifyEvent",
    "NotifySpec",
    "Precision",
    "ServingSpec",
    "TargetName",
    "Tolerances",
    "TritonServingSpec",
    "ValidationSpec",
    "allocation_problem",
    "format_bytes",
    "input_bytes",
    "load_spec",
    "spec_json_schema",
]


if TYPE_CHECKING:
    # The built-in members, spelled out for the type checker; at run time the enum holds every
    # registered target (services/descriptors), these first, so a new target needs no edit here.
    class TargetName(str, Enum):
        """An engine-native artifact a user can ask for."""

        ONNXRUNTIME = "onnxruntime"
        OPENVINO = "openvino"
        TFLITE = "tflite"
        TFSERVING = "tfserving"
        TENSORRT = "tensorrt"

else:
    TargetName = Enum(
        "TargetName",
        [(name.upper(), name) for name in registry().targets],
        type=str,
        module=__name__,
        qualname="TargetName",
    )
    TargetName.__doc__ = "An engine-native artifact a user can ask for."


class Precision(str, Enum):
    FP32 = "fp32"
    FP16 = "fp16"
    INT8 = "int8"
    INT4 = "int4"  # weight-only (MatMul weights), onnxruntime and openvino targets only


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", use_enum_values=False)


#: Bounds a spec must keep. Each is far above real use and far below what would allocate
#: memory or disk a machine does not have; they are in the JSON Schema so clients see them.
MAX_DIM = 1 << 20  # one axis of an input: a 1M-token sequence, a 1M-pixel side
MAX_BATCH = 1 << 16
MAX_ITERATIONS = 100_000
MAX_VERSION = (1 << 31) - 1  # Triton, TF Serving and OVMS all read versions as integers; most as int32
MAX_SEED = (1 << 32) - 1  # numpy's seed range a spec needs; the calibration set uses seed + 1
#: The most input data one validation set or one benchmark batch may take: refused above this,
#: before anything is allocated, with the estimate.
MAX_INPUT_BYTES = 4 << 30
MEMORY_HINT = "Lower the input dims, validation.samples or benchmark.batch_sizes."

Dim = Annotated[int, Field(ge=-1, le=MAX_DIM)]
PositiveDim = Annotated[int, Field(ge=1, le=MAX_DIM)]


class InputSpec(_Strict):
    """Shape of one model input. Use ``shape`` for a fixed shape, or min/opt/max for dynamic axes."""

    shape: list[Dim] | None = Field(
        default=None,
        description="Concrete shape used for validation, benchmarks and static engines; -1 keeps an axis dynamic.",
    )
    min: list[PositiveDim] | None = Field(default=None, description="Smallest shape (TensorRT profile).")
    opt: list[PositiveDim] | None = Field(default=None, description="Shape to optimise for.")
    max: list[PositiveDim] | None = Field(default=None, description="Largest shape (TensorRT profile).")
    dtype: str | None = Field(default=None, description="Override the input's dtype, e.g. float32, int64.")
    range: Annotated[list[float], Field(min_length=2, max_length=2)] | None = Field(
        default=None,
        description="[low, high] of the values generated for this input (floats uniform in it, integers in "
        "[low, high)); unset: taken from the calibration data when given, else the model's own bounds (token ids "
        "below its vocabulary) or a standard normal.",
    )

    value: bool | int | float | None = Field(
        default=None,
        description="One fixed value for this input. A tensor input is filled with it in generated samples (e.g. a "
        "sample rate, 16000); a non-tensor argument of a PyTorch forward() (int, float, bool) is baked into the "
        "artifact as a constant and leaves its signature.",
    )

    @model_validator(mode="after")
    def _profile_consistent(self) -> InputSpec:
        if self.range is not None and not self.range[0] < self.range[1]:
            raise ValueError(f"range needs low < high, got {self.range}")
        if self.range is not None and self.value is not None:
            raise ValueError("give range or value, not both")
        given = [s for s in (self.min, self.opt, self.max) if s is not None]
        if given and len(given) != 3:
            raise ValueError("give all of min, opt and max, or none of them")
        if given:
            assert self.min is not None and self.opt is not None and self.max is not None
            if not (len(self.min) == len(self.opt) == len(self.max)):
                raise ValueError("min, opt and max must have the same rank")
            for lo, mid, hi in zip(self.min, self.opt, self.max, strict=True):
                if not lo <= mid <= hi:
                    raise ValueError(f"each axis needs min <= opt <= max, got {lo}, {mid}, {hi}")
            if self.shape is not None and len(self.shape) != len(self.opt):
                raise ValueError("shape and opt must have the same rank")
        return self

    def concrete_shape(self) -> list[int] | None:
        """Return the shape to feed for validation: ``shape`` with -1 filled from ``opt``, else ``opt``."""
        if self.shape is not None:
            if self.opt is not None:
                return [o if d == -1 else d for d, o in zip(self.shape, self.opt, strict=True)]
            return list(self.shape)
        return list(self.opt) if self.opt is not None else None


class Tolerances(_Strict):
    """Parity bounds between an artifact and its source model; unset fields take the precision's default."""

    atol: float | None = Field(default=None, ge=0, description="Max absolute error allowed.")
    rtol: float | None = Field(default=None, ge=0, description="Max relative error allowed (|a-b| / (|b| + atol)).")
    min_cosine: float | None = Field(default=None, ge=-1, le=1, description="Minimum cosine similarity per output.")
    min_top1: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="Minimum top-1 agreement along each output's class axis (rows of [B,C], positions of "
        "[B,T,V], pixels of [N,C,H,W]; validation.class_axis sets it per output).",
    )
    min_pearson: float | None = Field(
        default=None,
        ge=-1,
        le=1,
        description="Minimum Pearson correlation per output and sample (centred: a constant map or a channel "
        "rounded away fails it, a shared bias cannot hide it).",
    )
    max_scale_error: float | None = Field(
        default=None,
        ge=0,
        description="Largest |slope - 1| of the artifact's output regressed on the source's, per output and sample "
        "(rounding noise leaves the slope at 1; a systematic scale does not).",
    )
    max_bias: float | None = Field(
        default=None,
        ge=0,
        description="Largest mean error per output and sample, in units of the source's standard deviation.",
    )
    min_snr_db: float | None = Field(
        default=None,
        ge=-100,
        le=200,
        description="Minimum signal-to-noise ratio in dB per output and sample: the source's variance over the "
        "error's mean square (a x2 scale or a bias of one standard deviation gives 0 dB or less).",
    )


#: Defaults per precision, from real pretrained models (benchmarks/bench_parity_bounds.py,
#: docs/benchmarks.md "Parity bounds on real models"): sound artifacts of 7 models from PyPI
#: wheels (OCR detector and recogniser, two classifiers, a file-type classifier, a YOLOv8
#: detector, a MiniLM text encoder) on onnxruntime and openvino. Cosine, Pearson and SNR are
#: the worst sample's, never an average. Lowest sound values measured: fp32 SNR 81.9 dB;
#: fp16 SNR 28.4 dB, Pearson 0.99928, |scale - 1| 0.0015; int8 (PP-OCRv4 recogniser on
#: OpenVINO, 11 of 12 held-out lines decoded identically) SNR 10.3 dB, Pearson/cosine 0.9525,
#: |scale - 1| 0.027, |bias| 0.029. Refused at every precision: x2 and x1.2 scales, biases of
#: one and of a third of a standard deviation, constant maps, a zeroed sample, noise at 5 dB.
#: Elementwise atol/rtol stay unset at int8 and int4: quantisation error is coarse by design.
DEFAULT_TOLERANCES: dict[Precision, Tolerances] = {
    Precision.FP32: Tolerances(
        atol=1e-4, rtol=1e-3, min_cosine=0.9999, min_top1=1.0,
        min_pearson=0.9999, min_snr_db=40.0, max_scale_error=0.001, max_bias=0.001,
    ),
    Precision.FP16: Tolerances(
        atol=2e-2, rtol=5e-2, min_cosine=0.999, min_top1=0.9,
        min_pearson=0.999, min_snr_db=25.0, max_scale_error=0.01, max_bias=0.01,
    ),
    Precision.INT8: Tolerances(
        atol=None, rtol=None, min_cosine=0.94, min_top1=0.75,
        min_pearson=0.94, min_snr_db=9.0, max_scale_error=0.1, max_bias=0.1,
    ),
    # int4 weight-only, MatMul weights in blocks of 32, logits cosine against fp32 measured on
    # random-weight GPT-2s: 2 layers, n_embd 64 (three seeds) 0.994 onnxruntime MatMulNBits,
    # 0.997 OpenVINO NNCF INT4_SYM, per-position top-1 0.98-1.00; 4 layers, n_embd 256,
    # vocabulary 8192 (benchmarks/bench_int4.py) 0.977-0.980 and 0.984-0.987. Error grows
    # with depth and width, so 0.95 leaves room for larger models; top-1 keeps int8's bound.
    Precision.INT4: Tolerances(
        atol=None, rtol=None, min_cosine=0.95, min_top1=0.75,
        min_pearson=0.93, min_snr_db=7.0, max_scale_error=0.15, max_bias=0.15,
    ),
}  # fmt: skip


class BenchmarkSpec(_Strict):
    """Latency/throughput measurement of each artifact on its engine."""

    enabled: bool = True
    batch_sizes: list[Annotated[int, Field(ge=1, le=MAX_BATCH)]] | None = Field(
        default=None,
        min_length=1,
        max_length=16,
        description="Batch sizes to time. Unset: 1 and the largest the batch axis allows (the inputs' max[0], "
        "max_batch_size), up to 8. A model with a fixed batch axis runs its own size.",
    )
    warmup: int = Field(default=5, ge=0, le=MAX_ITERATIONS, description="Runs discarded before timing.")
    iterations: int = Field(default=50, ge=1, le=MAX_ITERATIONS, description="Timed runs per batch size.")
    require_no_slower_than_fp32: bool = Field(
        default=False,
        description="fp16/int8 on onnxruntime or openvino: fail the target (SLOWER_THAN_FP32) when it is slower "
        "than the same model at fp32 on the same engine, timed side by side.",
    )


class ValidationSpec(_Strict):
    """How parity inputs are made when no calibration file is given, and how outputs are judged."""

    samples: int = Field(default=8, ge=1, le=1024, description="Number of seeded random samples.")
    seed: int = Field(default=0, ge=0, le=MAX_SEED, description="Seed for the random inputs.")
    min_unseen_samples: int = Field(
        default=8,
        ge=2,
        le=1024,
        description="Samples the quantiser never saw that a reduced-precision artifact's parity must rest on. When "
        "the calibration file holds out fewer, Kiln makes the rest from its rows (mixtures of two rows, perturbations "
        "within each input's measured range) and says so; generated inputs are made at least this many.",
    )
    confidence: float = Field(
        default=0.95,
        ge=0.5,
        le=0.999,
        description="One-sided confidence of the prediction bound each centred measure gets over the samples; the "
        "gate decides on its pessimistic end (where the next unseen input may fall).",
    )
    class_axis: dict[str, Annotated[int, Field(ge=0, le=8)] | None] = Field(
        default_factory=dict,
        description="Per output name: the axis holding class scores for top-1 agreement (in the output's own "
        "layout, batch axis 0), or null for none. Unset outputs: axis 1 of [B,C] and [N,C,H,W], the last of "
        "[B,T,V], none otherwise.",
    )
    localize: bool = Field(
        default=False,
        description="Also for a passing ONNX-family target (onnxruntime, openvino): find the first node whose "
        "output drifts from the fp32 graph's (a failing one always gets it).",
    )


class EvaluationMetric(str, Enum):
    """A task metric on labelled data (services/validation/task_metrics.py computes each)."""

    TOP1 = "top1"  # share of samples whose highest score is the label (labels [N])
    TOPK = "topk"  # share of samples whose label is among the k highest scores (labels [N])
    TOP1_PER_POSITION = "top1_per_position"  # share of positions right (labels [N, T]; negative = padding)
    MSE = "mse"  # mean squared error against the labels (lower is better)
    MAE = "mae"  # mean absolute error against the labels (lower is better)
    IOU = "iou"  # mean per-sample IoU of the map thresholded at `threshold` with the label masks

    @property
    def higher_is_better(self) -> bool:
        return self not in (EvaluationMetric.MSE, EvaluationMetric.MAE)


class EvaluationSpec(_Strict):
    """Task accuracy on labelled data: the source and every artifact scored, the drop bounded by ``max_drop``."""

    data: str = Field(
        description="An .npz of labelled samples: the inputs as a calibration file holds them (keyed by input name, "
        "samples on axis 0; or whole feeds keyed '<sample>/<input>') and their labels under `labels` (or "
        "'<sample>/labels'). Uploaded as the `evaluation` part of POST /compile.",
    )
    metric: EvaluationMetric = Field(
        default=EvaluationMetric.TOP1,
        description="top1 or topk (labels: a class index per sample), top1_per_position (sequence logits; labels: "
        "a class index per position, negative ones ignored), mse or mae (labels: the expected output), iou (labels: "
        "a 0/1 mask per sample; the output thresholded at `threshold`).",
    )
    output: str | None = Field(
        default=None, description="The output scored; unset: the model's only output (a model with more must say)."
    )
    max_drop: float = Field(
        default=0.01,
        ge=0,
        description="The most an artifact may lose against the source, in the metric's own units (0.01 = one point "
        "of top-1; for mse/mae the rise allowed). A target past it fails with ACCURACY_DROP_EXCEEDED and both "
        "scores; int8 on onnxruntime and openvino searches for an artifact within it.",
    )
    k: int = Field(default=5, ge=1, le=1000, description="topk: how many of the highest scores count.")
    threshold: float = Field(default=0.5, description="iou: an output value above this is foreground.")
    class_axis: int = Field(
        default=-1, ge=-8, le=8, description="top1, topk, top1_per_position: the output's axis of class scores."
    )
    accuracy_aware_int8: bool = Field(
        default=True,
        description="int8 on onnxruntime and openvino searches for an artifact within max_drop on this data "
        "(NNCF's accuracy control; onnxruntime's auto_exclude judged by the metric). false: quantise as without "
        "labels and only judge the result.",
    )


#: Most Triton model instances a spec may ask for (instance_group count).
MAX_INSTANCES = 64


class TritonServingSpec(_Strict):
    """How Triton runs the published model: instances, batching and engine parameters (``kiln tune`` measures them).

    These change the config.pbtxt only, never the artifact: an export's cache key leaves them
    out. Each engine parameter reaches the backends that accept it (onnxruntime backend:
    ``intra_op_thread_count`` and ``optimization.graph.level``; OpenVINO backend:
    ``INFERENCE_NUM_THREADS``, ``NUM_STREAMS``, ``PERFORMANCE_HINT``); others ignore it.
    """

    instance_count: int | None = Field(
        default=None, ge=1, le=MAX_INSTANCES, description="instance_group count: model instances Triton runs at once."
    )
    preferred_batch_sizes: list[Annotated[int, Field(ge=1, le=MAX_BATCH)]] | None = Field(
        default=None,
        max_length=16,
        description="dynamic_batching preferred_batch_size (sizes above max_batch_size are dropped). Unset: the "
        "benchmarked sizes within 10% of the best throughput.",
    )
    threads: int | None = Field(
        default=None,
        ge=0,
        le=1024,
        description="Threads per instance: onnxruntime's intra_op_thread_count, OpenVINO's INFERENCE_NUM_THREADS.",
    )
    onnxruntime_optimization: Literal["all", "extended", "basic", "disable"] | None = Field(
        default=None, description="onnxruntime graph optimisation level (optimization.graph.level); unset: all."
    )
    openvino_streams: int | None = Field(default=None, ge=1, le=1024, description="OpenVINO NUM_STREAMS.")
    openvino_hint: Literal["LATENCY", "THROUGHPUT", "CUMULATIVE_THROUGHPUT"] | None = Field(
        default=None, description="OpenVINO PERFORMANCE_HINT."
    )


class ServingSpec(_Strict):
    """How the published repository is served: where servers mount it, which device they run on."""

    root: str | None = Field(
        default=None,
        description="Path at which the serving engines see the repository (e.g. /models in their containers); "
        "base_path in tfserving/models.config and ovms/config.json is <root>/<server root>/<name>. Recorded in the "
        "repository for later publishes; unset = the recorded one, else KILN_SERVING_ROOT, else the repository's "
        "own location.",
    )

    @field_validator("root")
    @classmethod
    def _absolute_root(cls, v: str | None) -> str | None:
        # A relative base_path is resolved against each server's working directory: never what was meant.
        if v is not None and not (v.startswith("/") or "://" in v):
            raise ValueError("must be an absolute path (e.g. /models) or a URL (e.g. s3://bucket/prefix)")
        return v

    onnxruntime_device: Literal["cpu", "gpu"] = Field(
        default="cpu",
        description="Where Triton runs onnxruntime models: cpu (instance_group KIND_CPU) or gpu (KIND_GPU, "
        "onnxruntime's CUDA provider). With gpu, a live GPU worker (queue kiln.gpu-<variant>) checks parity and "
        "times the artifact on its GPU; without one it is checked on the CPU provider and says so in a warning "
        "(require_device_check: true refuses that).",
    )
    triton: TritonServingSpec = Field(
        default_factory=TritonServingSpec,
        description="Triton instances, batching and engine parameters for the published config.pbtxt.",
    )


class NotifyEvent(str, Enum):
    """When a webhook is called: when the job ends (``finished``), or only when it ends so."""

    FINISHED = "finished"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


#: The shortest webhook secret accepted: 128 bits as hex.
MIN_WEBHOOK_SECRET = 16


class NotifySpec(_Strict):
    """A webhook (service only): a signed POST of the job's summary to ``url`` when it ends."""

    url: str = Field(
        max_length=2048,
        pattern=r"^https?://[^\s/?#]+",
        description="Where to POST: an http(s) URL. Loopback, link-local and private addresses are refused unless "
        "the operator allows them (KILN_WEBHOOK_ALLOW_NETWORKS).",
    )
    events: list[NotifyEvent] = Field(
        default_factory=lambda: [NotifyEvent.FINISHED],
        min_length=1,
        description="When to call it: finished (whenever the job ends), succeeded, failed, cancelled.",
    )
    secret: SecretStr | None = Field(
        default=None,
        description="The HMAC-SHA256 key that signs each POST (X-Kiln-Signature), at least 16 characters. "
        "Write-only: kept out of the job's stored and shown spec. Unset: the service's KILN_WEBHOOK_SECRET.",
    )

    @field_validator("secret")
    @classmethod
    def _long_enough(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and len(v.get_secret_value()) < MIN_WEBHOOK_SECRET:
            raise ValueError(f"must have at least {MIN_WEBHOOK_SECRET} characters")
        return v


#: The largest batch size timed by default: enough to show batching's effect, small enough to be quick.
DEFAULT_BENCHMARK_MAX_BATCH = 8


NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"


def _engine_options_model() -> type[BaseModel]:
    """Return the model of the spec's ``options``: one field per engine or source format with an options model."""
    fields: dict[str, Any] = {}
    for name, d in option_sections().items():
        assert d.options is not None
        fields[name] = (d.options, Field(default_factory=d.options, description=(d.options.__doc__ or "").strip()))
    return create_model(  # type: ignore[no-any-return,call-overload]
        "EngineOptions",
        __base__=_Strict,
        __doc__="Per-engine settings, each section contributed by its engine.",
        **fields,
    )


if TYPE_CHECKING:
    EngineOptions = BaseModel
else:
    EngineOptions = _engine_options_model()

_Options = TypeVar("_Options", bound=BaseModel)


def _legacy_fields() -> dict[str, tuple[str, str]]:
    """Return the top-level spec fields from before ``options``: old name -> (engine, options field)."""
    return {old: (e.name, new) for e in registry().engines.values() for old, new in e.legacy_spec_fields.items()}


def _legacy_schema(schema: dict[str, Any]) -> None:
    """Document the pre-``options`` fields (still accepted) in the JSON Schema, marked deprecated."""
    engines = registry().engines
    for old, (engine, new) in _legacy_fields().items():
        model = engines[engine].options
        assert model is not None
        prop = dict(model.model_json_schema()["properties"][new])
        prop["deprecated"] = True
        prop["title"] = old.replace("_", " ").title()
        prop["description"] = f"Deprecated spelling of options.{engine}.{new}. " + prop.get("description", "")
        schema.setdefault("properties", {})[old] = prop


class CompileSpec(_Strict):
    """What to compile: targets, precision, shapes, naming and checks."""

    model_config = ConfigDict(extra="forbid", use_enum_values=False, json_schema_extra=_legacy_schema)

    targets: list[TargetName] = Field(min_length=1, description="Engines to build artifacts for.")
    precision: Precision = Field(default=Precision.FP32, description="Numeric precision of the artifacts.")
    inputs: dict[str, InputSpec] = Field(
        default_factory=dict, description="Per-input shapes, keyed by input name; dynamic axes need shape or opt."
    )
    max_batch_size: int | None = Field(
        default=None,
        ge=0,
        le=MAX_BATCH,
        description="Triton max_batch_size; 0 disables batching. Unset: the largest batch the artifact takes "
        "(a TensorRT profile's, else the inputs' max[0]) up to 8 when every input and output has an open batch "
        "axis, else 0.",
    )
    opset: int | None = Field(default=None, ge=7, le=24, description="ONNX opset for exported graphs.")
    name: str | None = Field(default=None, pattern=NAME_PATTERN, description="Published model name.")
    version: int | None = Field(
        default=None, ge=1, le=MAX_VERSION, description="Published version; next free one when unset."
    )
    calibration: str | None = Field(
        default=None,
        description="An .npz for int8 calibration and parity inputs: arrays keyed by input name (samples stacked on "
        "axis 0), or whole feeds keyed '<sample>/<input>' (any shapes, scalars and states batched on another axis).",
    )
    integer_io: bool = Field(
        default=False,
        description=(
            "int8 tflite only: int8 inputs and outputs (their scale and zero point in the manifest's io), "
            "which needs calibration data. Otherwise every artifact takes and gives float32 at every precision."
        ),
    )
    tolerances: Tolerances = Field(default_factory=Tolerances, description="Parity bounds; unset = precision default.")
    evaluation: EvaluationSpec | None = Field(
        default=None,
        description="Labelled data to score the source and every artifact on (a task metric and the drop allowed).",
    )
    benchmark: BenchmarkSpec | bool = Field(default_factory=BenchmarkSpec, description="true/false or settings.")
    validation: ValidationSpec = Field(default_factory=ValidationSpec)
    source_format: Format | None = Field(default=None, description="Override content-based format detection.")
    signature: str = Field(default="serving_default", description="SavedModel signature to compile.")
    optimize: bool = Field(default=True, description="Run Kiln's ONNX optimisation passes when routing via ONNX.")
    options: EngineOptions = Field(
        default_factory=EngineOptions,
        description="Per-engine settings: one typed section per engine (or source format) that has any, e.g. options.tensorrt.",
    )
    wait_for_workers: bool = Field(
        default=False,
        description=(
            "Service only: accept the job even when an engine it needs has no live worker. Its steps then "
            "wait up to KILN_WORKER_WAIT_SECONDS for one and fail with ENGINE_UNAVAILABLE after that; "
            "without this the submission is refused (503 ENGINE_UNAVAILABLE)."
        ),
    )
    require_device_check: bool = Field(
        default=False,
        description=(
            "A GPU-bound artifact (serving.onnxruntime_device: gpu, options.tvm.cuda_arch) must be checked on a GPU "
            "worker: the job is refused (ENGINE_UNAVAILABLE) when none is live, or, with wait_for_workers, waits "
            "for one. Unset: without a GPU worker it is checked on the CPU and published with a warning saying so."
        ),
    )
    serving: ServingSpec = Field(default_factory=ServingSpec, description="How servers load the repository.")
    notify: NotifySpec | None = Field(
        default=None,
        description="Service only: a webhook called when the job ends (a signed POST of its summary, retried; "
        "recorded in the job's events). `kiln compile` run locally ignores it.",
    )

    @model_validator(mode="before")
    @classmethod
    def _fold_legacy_fields(cls, data: Any) -> Any:
        # `tensorrt_variant` and friends predate `options`: accepted, moved to options.<engine>.<field>.
        if not isinstance(data, dict):
            return data
        legacy = {k: v for k, v in _legacy_fields().items() if k in data}
        if not legacy:
            return data
        data = dict(data)
        options = data.get("options")
        options = dict(options) if isinstance(options, dict) else ({} if options is None else options)
        if not isinstance(options, dict):
            return data  # the field's own validation reports it
        for old, (engine, new) in legacy.items():
            section = options.get(engine)
            section = dict(section) if isinstance(section, dict) else ({} if section is None else section)
            if not isinstance(section, dict):
                continue
            if new in section:
                raise ValueError(f"give options.{engine}.{new} or its deprecated spelling {old}, not both")
            section[new] = data.pop(old)
            options[engine] = section
        data["options"] = options
        return data

    def engine_options(self, model: type[_Options]) -> _Options:
        """Return the ``options`` section whose model is ``model`` (e.g. TensorRTOptions)."""
        for name in type(self.options).model_fields:
            value = getattr(self.options, name)
            if isinstance(value, model):
                return value
        raise KeyError(f"no engine registers options of type {model.__name__}")

    def options_for(self, name: str) -> BaseModel | None:
        """Return the options section of engine family or source format ``name``, or None when it has none."""
        value = getattr(self.options, name, None)
        return value if isinstance(value, BaseModel) else None

    @field_validator("targets")
    @classmethod
    def _unique_targets(cls, v: list[TargetName]) -> list[TargetName]:
        if len(set(v)) != len(v):
            raise ValueError("targets must not repeat")
        return v

    @field_validator("integer_io")
    @classmethod
    def _integer_io_applies(cls, v: bool, info: ValidationInfo) -> bool:
        # A field validator (not a model one) so that the error names the field.
        precision, targets = info.data.get("precision"), info.data.get("targets") or []
        if v and (precision is not Precision.INT8 or TargetName.TFLITE not in targets):
            raise ValueError(
                "integer inputs and outputs are an int8 tflite contract: set precision int8 and "
                "include the tflite target, or leave integer_io false"
            )
        return v

    @field_validator("benchmark")
    @classmethod
    def _benchmark_object(cls, v: BenchmarkSpec | bool) -> BenchmarkSpec | bool:
        return BenchmarkSpec(enabled=v) if isinstance(v, bool) else v

    @property
    def batch_limit(self) -> int | None:
        """Return the smallest ``max[0]`` among the inputs' shape profiles, or None without profiles."""
        limits = [i.max[0] for i in self.inputs.values() if i.max]
        return min(limits) if limits else None

    @property
    def benchmark_batch_sizes(self) -> list[int]:
        """Return the batch sizes to time: the spec's, else 1 and the largest allowed up to 8."""
        if self.bench.batch_sizes:
            return list(self.bench.batch_sizes)
        top = DEFAULT_BENCHMARK_MAX_BATCH
        for bound in (self.batch_limit, self.max_batch_size):
            if bound:
                top = min(top, bound)
        return sorted({1, top})

    @property
    def bench(self) -> BenchmarkSpec:
        """Return the benchmark settings (the field accepts a bare boolean)."""
        assert isinstance(self.benchmark, BenchmarkSpec)
        return self.benchmark

    def tolerances_for(self, precision: Precision | None = None) -> Tolerances:
        """Return the effective tolerances: the spec's fields over the precision's defaults."""
        base = DEFAULT_TOLERANCES[precision or self.precision]
        overrides = self.tolerances.model_dump(exclude_none=True)
        return base.model_copy(update=overrides)


def _itemsize(dtype: str | None) -> int:
    import numpy as np

    try:
        return int(np.dtype(dtype or "float32").itemsize)
    except TypeError:
        return 4


def input_bytes(shapes: dict[str, tuple[list[int], str | None]]) -> int:
    """Return the bytes one feed of these inputs takes: name -> (shape, dtype); -1 and 0 count as 1."""
    total = 0
    for shape, dtype in shapes.values():
        n = 1
        for d in shape:
            n *= max(int(d), 1)
        total += n * _itemsize(dtype)
    return total


def format_bytes(n: float) -> str:
    """Return ``n`` bytes as a short human figure (``1.2 TiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.3g} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def allocation_problem(field_name: str, what: str, nbytes: int) -> dict[str, Any] | None:
    """Return an INVALID_SPEC problem when ``nbytes`` of input data is over MAX_INPUT_BYTES, else None."""
    if nbytes <= MAX_INPUT_BYTES:
        return None
    return {
        "field": field_name,
        "problem": f"{what} needs about {format_bytes(nbytes)} of input memory; the limit is "
        f"{format_bytes(MAX_INPUT_BYTES)}",
    }


def _memory_problems(spec: CompileSpec) -> list[dict[str, Any]]:
    """Return the spec's shapes that would allocate more than MAX_INPUT_BYTES, judged from the spec alone.

    Inputs the spec leaves out take the model's dims, known only when the job runs; the
    validation and benchmark code checks those again, with the same limit, before allocating.
    """
    concrete = {n: (i.concrete_shape(), i.dtype) for n, i in spec.inputs.items() if i.concrete_shape() is not None}
    shapes = {n: (list(shape or []), dtype) for n, (shape, dtype) in concrete.items()}
    problems = []
    if shapes:
        largest = max(shapes, key=lambda n: input_bytes({n: shapes[n]}))
        per_sample = input_bytes(shapes)
        problems.append(
            allocation_problem(
                f"inputs.{largest}",
                f"the validation set ({spec.validation.samples} samples of {format_bytes(per_sample)})",
                spec.validation.samples * per_sample,
            )
        )
        if spec.bench.enabled:
            for b in spec.benchmark_batch_sizes:
                batched = {n: ([b, *shape[1:]] if shape else shape, dt) for n, (shape, dt) in shapes.items()}
                problems.append(
                    allocation_problem("benchmark.batch_sizes", f"a benchmark batch of {b}", input_bytes(batched))
                )
    for n, i in spec.inputs.items():
        if i.max is not None:
            problems.append(
                allocation_problem(
                    f"inputs.{n}.max", f"input {n} at its largest shape {i.max}", input_bytes({n: (i.max, i.dtype)})
                )
            )
    return [p for p in problems if p is not None]


#: pydantic names the member of a union field in an error's location ("benchmark.BenchmarkSpec.iterations");
#: a user's field path has no such part.
_UNION_TAGS = {"BenchmarkSpec", "bool"}


def _format_errors(exc: ValidationError, data: dict[str, Any] | None = None) -> tuple[str, list[dict[str, Any]]]:
    errors = exc.errors()
    # A deprecated top-level field is reported under the name the user gave.
    renamed = {f"options.{engine}.{new}": old for old, (engine, new) in _legacy_fields().items() if old in (data or {})}
    # `benchmark` takes an object or a boolean: an object that fails also "is not a boolean", which says nothing.
    objects = {str(e["loc"][0]) for e in errors if len(e["loc"]) > 2 and e["loc"][1] == "BenchmarkSpec"}
    problems = []
    for err in errors:
        parts = [str(p) for p in err["loc"]]
        if len(parts) == 2 and parts[1] == "bool" and parts[0] in objects:
            continue
        loc = ".".join(p for p in parts if p not in _UNION_TAGS) or "(spec)"
        loc = renamed.get(loc, loc)
        problems.append({"field": loc, "problem": err["msg"]})
    text = "; ".join(f"{p['field']}: {p['problem']}" for p in problems)
    return text, problems


def load_spec(data: dict[str, Any] | str | Path) -> CompileSpec:
    """Parse a spec from a dict, a JSON string or a JSON file; INVALID_SPEC names the fields."""
    try:
        if isinstance(data, Path):
            data = json.loads(data.read_text())
        elif isinstance(data, str):
            data = json.loads(data)
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidSpec(f"spec is not readable JSON: {exc}") from exc
    except RecursionError as exc:  # json's decoder recurses once per level of [ or {
        raise InvalidSpec(
            "spec is nested too deeply to read", errors=[{"field": "(spec)", "problem": "nested too deeply"}]
        ) from exc
    if not isinstance(data, dict):
        raise InvalidSpec("spec must be a JSON object")
    try:
        spec = CompileSpec.model_validate(data)
    except ValidationError as exc:
        text, problems = _format_errors(exc, data)
        hint = None
        if any(p["field"].startswith("targets") for p in problems):
            hint = "Valid targets: " + ", ".join(t.value for t in TargetName) + "."
        raise InvalidSpec(f"invalid spec: {text}", hint=hint, errors=problems) from exc
    problems = _memory_problems(spec)
    if problems:
        raise InvalidSpec(
            "invalid spec: " + "; ".join(f"{p['field']}: {p['problem']}" for p in problems),
            hint=MEMORY_HINT,
            errors=problems,
        )
    return spec


def spec_json_schema() -> dict[str, Any]:
    """Return the CompileSpec JSON Schema (the one the API's OpenAPI document embeds)."""
    return CompileSpec.model_json_schema()
