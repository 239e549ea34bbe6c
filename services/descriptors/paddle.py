"""PaddlePaddle sources: ProgramDesc (.pdmodel) and PIR (.json) inference models, read on the paddle worker.

Paddle Inference gives the reference outputs; paddle2onnx brings both program formats to
ONNX, and OpenVINO's Paddle frontend reads a .pdmodel directly (it does not read PIR).
Detection and vetting are pure Python (services.formats.paddle): the API never imports Paddle.
"""

from __future__ import annotations

from services.descriptors._types import ConverterDescriptor, EngineDescriptor, FormatDescriptor, WorkerImage

DESCRIPTORS = (
    EngineDescriptor(
        name="paddle",
        description="PaddlePaddle inference and paddle2onnx (Paddle sources)",
        modules=("paddle", "paddle2onnx"),
        extra="paddle",
        packages=("paddlepaddle", "paddle2onnx", "onnx", "numpy"),
        # docker/Dockerfile also installs libgomp1 for ENGINE=paddle (libpaddle.so links it).
        image=WorkerImage(extras=("paddle", "service")),
        # Nothing preloaded: Paddle starts its own threads at import.
    ),
    FormatDescriptor(
        name="paddle",
        label="PaddlePaddle inference model (.pdmodel + .pdiparams)",
        extensions=(".pdmodel",),
        runner="services.runners.paddle:PaddleRunner",
        source_engine="paddle",
        detect="services.formats.paddle:sniff_pdmodel",
        detect_archive="services.formats.paddle:sniff_pdmodel_members",
        loadable="services.formats.paddle:pdmodel_program",
    ),
    FormatDescriptor(
        name="paddle_pir",
        label="PaddlePaddle 3 inference model (PIR .json + .pdiparams)",
        runner="services.runners.paddle:PaddleRunner",
        source_engine="paddle",
        detect="services.formats.paddle:sniff_pir",
        detect_archive="services.formats.paddle:sniff_pir_members",
        loadable="services.formats.paddle:pir_program",
    ),
    ConverterDescriptor(
        "paddle-to-onnx",
        "paddle",
        "onnx",
        "paddle",
        3.0,
        "services.converters.paddle_onnx:paddle_to_onnx",
        "paddle2onnx",
    ),
    ConverterDescriptor(
        "paddle-pir-to-onnx",
        "paddle_pir",
        "onnx",
        "paddle",
        3.0,
        "services.converters.paddle_onnx:paddle_to_onnx",
        "paddle2onnx",
    ),
    ConverterDescriptor(
        "paddle-to-openvino-ir",
        "paddle",
        "openvino_ir",
        "openvino",
        1.5,
        "services.converters.paddle_openvino:paddle_to_ir",
        "openvino.convert_model (Paddle frontend)",
    ),
)
