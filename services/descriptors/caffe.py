"""Caffe sources (deploy .prototxt + .caffemodel): read and converted on the onnxruntime worker.

No Caffe framework runs here: Kiln reads both files as data (services/formats/caffe.py),
converts them layer by layer (services/converters/caffe_to_onnx.py), and OpenCV's dnn module
(opencv-python-headless, in the onnxruntime extra) gives the independent reference outputs.
"""

from __future__ import annotations

from services.descriptors._types import ConverterDescriptor, FormatDescriptor

DESCRIPTORS = (
    FormatDescriptor(
        name="caffe",
        label="Caffe (.prototxt+.caffemodel)",
        runner="services.runners.caffe:CaffeRunner",
        source_engine="onnxruntime",  # OpenCV (the reference) and the converter ride in the onnxruntime image
        # A directory or archive holding both files; either half alone is refused with a hint.
        detect="services.formats.caffe:sniff_caffe",
        detect_archive="services.formats.caffe:caffe_members_kind",
        # Vets the deploy net (sizes, Python layers: UNSAFE_INPUT) when open_source resolves the
        # upload, i.e. at submission, before any step or framework reads it.
        loadable="services.formats.caffe:vetted_caffe_root",
    ),
    ConverterDescriptor(
        "caffe-to-onnx",
        "caffe",
        "onnx",
        "onnxruntime",
        2.0,
        "services.converters.caffe_to_onnx:caffe_to_onnx",
        "kiln caffe_to_onnx",
    ),
)
