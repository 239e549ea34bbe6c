"""TensorFlow: Keras, SavedModel and TFLite formats, the tflite and tfserving targets, tf2onnx/onnx2tf edges."""

from __future__ import annotations

from services.descriptors._types import (
    ConverterDescriptor,
    EngineDescriptor,
    FormatDescriptor,
    TargetDescriptor,
    WorkerImage,
)

#: int4 is weight-only MatMul compression: only onnxruntime (MatMulNBits) and OpenVINO (NNCF) build it.
WITHOUT_INT4 = frozenset({"fp32", "fp16", "int8"})

DESCRIPTORS = (
    EngineDescriptor(
        name="tensorflow",
        description="TensorFlow, Keras, TFLite and TF Serving exports",
        modules=("tensorflow",),
        extra="tensorflow",
        packages=("tensorflow", "keras", "tf2onnx", "onnx2tf", "ai-edge-litert", "onnx", "numpy"),
        image=WorkerImage(extras=("tensorflow", "service")),
        # TensorFlow is never preloaded: it does not support being forked after import.
    ),
    FormatDescriptor(
        name="keras",
        label="Keras (.keras/.h5)",
        extensions=(".keras", ".h5"),
        runner="services.runners.tensorflow:KerasRunner",
        source_engine="tensorflow",
        archive_is_the_model=True,  # a zip its loader reads whole
    ),
    FormatDescriptor(
        name="savedmodel",
        label="TF SavedModel (dir/.zip/.tar.gz)",
        extensions=(".tar.gz", ".tgz", ".zip", ".tar"),
        runner="services.runners.tensorflow:SavedModelRunner",
        source_engine="tensorflow",
        vet="services.formats.savedmodel:vet_savedmodel",
    ),
    FormatDescriptor(
        name="tflite",
        label="TFLite",
        extensions=(".tflite",),
        runner="services.runners.tflite:TFLiteRunner",
        source_engine="tensorflow",
        vet="services.formats.tflite:vet_tflite",
    ),
    TargetDescriptor(
        name="tflite",
        engine="tensorflow",
        # Keras arrives as keras-to-savedmodel's output: TF's converter exports Keras 3 models to a
        # SavedModel internally anyway, and as a step it is cached and shared with tfserving/openvino.
        accepts={"savedmodel": 1.5, "tflite": 0.5},
        entry="services.exporters.tflite:export_tflite",
        artifact_format="tflite",
        server_root="tflite",
        precisions={"savedmodel": WITHOUT_INT4, "tflite": frozenset({"fp32"})},
    ),
    TargetDescriptor(
        name="tfserving",
        engine="tensorflow",
        accepts={"savedmodel": 1.0},
        entry="services.exporters.tfserving:export_tfserving",
        artifact_format="savedmodel",
        server_root="tfserving",
        # fp16/int8: weights stored at that precision, fp32 compute (see services/exporters/tfserving.py)
        precisions={"savedmodel": WITHOUT_INT4},
    ),
    # --- to ONNX, the canonical graph ---
    ConverterDescriptor(
        "keras-to-onnx",
        "keras",
        "onnx",
        "tensorflow",
        3.0,
        "services.converters.tensorflow_to_onnx:keras_to_onnx",
        "tf2onnx",
    ),
    ConverterDescriptor(
        "savedmodel-to-onnx",
        "savedmodel",
        "onnx",
        "tensorflow",
        3.0,
        "services.converters.tensorflow_to_onnx:savedmodel_to_onnx",
        "tf2onnx",
    ),
    ConverterDescriptor(
        "tflite-to-onnx",
        "tflite",
        "onnx",
        "tensorflow",
        3.0,
        "services.converters.tensorflow_to_onnx:tflite_to_onnx",
        "tf2onnx",
    ),
    # --- native TensorFlow routes (no ONNX round trip) ---
    ConverterDescriptor(
        "keras-to-savedmodel",
        "keras",
        "savedmodel",
        "tensorflow",
        1.0,
        "services.converters.tensorflow_native:keras_to_savedmodel",
        "tf.saved_model",
    ),
    ConverterDescriptor(
        "onnx-to-savedmodel",
        "onnx",
        "savedmodel",
        "tensorflow",
        4.0,
        "services.converters.onnx_to_tensorflow:onnx_to_savedmodel",
        "onnx2tf",
    ),
)
