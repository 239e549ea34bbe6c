# Kiln's TensorRT worker, one image per CUDA variant, on NVIDIA's TensorRT base images.
#
#   docker build -f docker/tensorrt.Dockerfile -t kiln/worker-tensorrt-cu12 \
#       --build-arg CUDA_VARIANT=cu12 --build-arg TENSORRT_VERSION=10.8.0.43 \
#       --build-arg BASE_IMAGE=nvcr.io/nvidia/tensorrt:25.01-py3 .
#   docker build -f docker/tensorrt.Dockerfile -t kiln/worker-tensorrt-cu13 \
#       --build-arg CUDA_VARIANT=cu13 --build-arg TENSORRT_VERSION=11.4.0.106 \
#       --build-arg BASE_IMAGE=nvcr.io/nvidia/tensorrt:26.10-py3 .
#
# BASE_IMAGE provides the CUDA runtime, cuDNN and the driver-compatibility setup of the variant;
# TENSORRT_VERSION must be a TensorRT release built for that CUDA major version.
#
# Why not the base image's own Python: NVIDIA's recent images ship Python 3.12, and Kiln is
# locked on 3.11 (TensorFlow, onnx2tf and the lock were resolved there). uv installs a
# standalone CPython 3.11 under /opt/python, and TensorRT's cp311 wheels come with their own
# libraries (tensorrt-cuXX-libs), so the Python bindings always match the libraries they load.
ARG BASE_IMAGE=nvcr.io/nvidia/tensorrt:25.01-py3
ARG UV_VERSION=0.13.8

FROM ghcr.io/astral-sh/uv:${UV_VERSION} AS uv

# ---------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS build
ARG CUDA_VARIANT=cu12
ARG TENSORRT_VERSION=10.8.0.43
ARG TENSORRT_INDEX_URL=https://pypi.nvidia.com
ARG PYTHON_VERSION=3.11
ENV UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_NO_CACHE=1 \
    UV_LINK_MODE=copy \
    PYTHONDONTWRITEBYTECODE=1
COPY --from=uv /uv /usr/local/bin/uv
WORKDIR /src
RUN uv python install "${PYTHON_VERSION}" \
    && uv venv --python "${PYTHON_VERSION}" /opt/kiln
# Dependencies first (see docker/Dockerfile). The `tensorrt` metapackage picks its CUDA variant
# by version; pinning both it and the variant's package keeps a cu12 image from silently
# pulling cu13 libraries (or the reverse).
COPY pyproject.toml constraints.txt docker/extras_requirements.py ./
RUN /opt/kiln/bin/python extras_requirements.py pyproject.toml tensorrt,service > requirements.txt \
    && uv pip install --python /opt/kiln/bin/python --extra-index-url "${TENSORRT_INDEX_URL}" \
        -c constraints.txt -r requirements.txt \
        "tensorrt==${TENSORRT_VERSION}" "tensorrt-${CUDA_VARIANT}==${TENSORRT_VERSION}"
# The context holds only what the package needs (tensorrt.Dockerfile.dockerignore).
COPY . .
RUN uv pip install --python /opt/kiln/bin/python --no-deps . \
    && install -m 0755 docker/worker_healthcheck.py /opt/kiln/bin/kiln-worker-healthcheck \
    && /opt/kiln/bin/python -I -c "import sys; from services.graph.engines import engine; e = engine(sys.argv[1]); sys.exit(0 if e.is_installed() else 'tensorrt is not importable')" "tensorrt-${CUDA_VARIANT}"

# ---------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE}
ARG CUDA_VARIANT=cu12
ARG TENSORRT_VERSION=10.8.0.43
LABEL org.opencontainers.image.title="kiln-worker-tensorrt-${CUDA_VARIANT}" \
      org.opencontainers.image.description="Kiln compile worker for TensorRT ${TENSORRT_VERSION} (${CUDA_VARIANT}, queue kiln.tensorrt-${CUDA_VARIANT})"
RUN groupadd --gid 10001 kiln \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /var/lib/kiln --shell /usr/sbin/nologin kiln \
    && install -d -o 10001 -g 10001 /var/lib/kiln /var/lib/kiln/cache /var/lib/kiln/data
COPY --from=build /opt/python /opt/python
COPY --from=build /opt/kiln /opt/kiln
ENV PATH=/opt/kiln/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/var/lib/kiln \
    KILN_CACHE_DIR=/var/lib/kiln/cache \
    KILN_DATA_DIR=/var/lib/kiln/data \
    KILN_ENGINE=tensorrt-${CUDA_VARIANT}
WORKDIR /var/lib/kiln
USER 10001:10001
HEALTHCHECK --interval=30s --timeout=20s --start-period=60s --retries=3 CMD ["kiln-worker-healthcheck"]
CMD ["sh", "-c", "exec kiln worker --engine \"$KILN_ENGINE\""]
