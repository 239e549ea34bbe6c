# Kiln's GPU worker: checks and times GPU-bound artifacts on the NVIDIA GPU that serves them
# (queue kiln.gpu-<variant>; services/descriptors/gpu.py). Built from PyPI wheels alone:
# onnxruntime-gpu (built for CUDA 13) with NVIDIA's CUDA runtime, cuBLAS and cuDNN wheels, TVM
# with its CUDA runtime, nvcc (nvidia-cuda-nvcc) and NVML's bindings. The GPU driver is not in
# the image: NVIDIA's container toolkit mounts it (compose: the `gpu` profile; Kubernetes: an
# nvidia.com/gpu resource on a node running the device plugin).
#
#   docker build -f docker/gpu.Dockerfile -t kiln/worker-gpu-cu13 --build-arg CUDA_VARIANT=cu13 .
#
# The build has no GPU, so it checks what it can: the modules import and onnxruntime carries its
# CUDA provider; the worker itself refuses to serve its queue where NVML sees no GPU.
ARG BASE_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS build
ARG CUDA_VARIANT=cu13
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY pyproject.toml constraints.txt docker/extras_requirements.py ./
RUN python3 -m venv /opt/kiln \
    && /opt/kiln/bin/python extras_requirements.py pyproject.toml "gpu,service" > requirements.txt \
    && /opt/kiln/bin/pip install --no-cache-dir -c constraints.txt -r requirements.txt
# The context holds only what the package needs (gpu.Dockerfile.dockerignore is an allowlist).
COPY . .
RUN /opt/kiln/bin/pip install --no-cache-dir --no-deps . \
    && /opt/kiln/bin/pip check \
    && install -m 0755 docker/worker_healthcheck.py /opt/kiln/bin/kiln-worker-healthcheck \
    && /opt/kiln/bin/python -I -c "import sys, onnxruntime, pynvml; from services.graph.engines import engine; e = engine(sys.argv[1]); sys.exit(0 if 'CUDAExecutionProvider' in onnxruntime.get_available_providers() else f'onnxruntime {onnxruntime.__version__} has no CUDA provider: {e.name} needs onnxruntime-gpu')" "gpu-${CUDA_VARIANT}"

# ---------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE}
ARG CUDA_VARIANT=cu13
LABEL org.opencontainers.image.title="kiln-worker-gpu-${CUDA_VARIANT}" \
      org.opencontainers.image.description="Kiln GPU worker (${CUDA_VARIANT}): parity and benchmark of GPU-bound artifacts on the GPU, queue kiln.gpu-${CUDA_VARIANT}"
# bubblewrap confines each step (services/sandbox), as in the CPU workers.
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 kiln \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /var/lib/kiln --shell /usr/sbin/nologin kiln \
    && install -d -o 10001 -g 10001 /var/lib/kiln /var/lib/kiln/cache /var/lib/kiln/data \
    && install -d -o 10001 -g 10001 -m 0700 /run/kiln/secrets
COPY --from=build /opt/kiln /opt/kiln
ENV PATH=/opt/kiln/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/var/lib/kiln \
    KILN_CACHE_DIR=/var/lib/kiln/cache \
    KILN_DATA_DIR=/var/lib/kiln/data \
    KILN_ENGINE=gpu-${CUDA_VARIANT} \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
WORKDIR /var/lib/kiln
USER 10001:10001
HEALTHCHECK --interval=30s --timeout=20s --start-period=60s --retries=3 CMD ["kiln-worker-healthcheck"]
CMD ["sh", "-c", "exec kiln worker --engine \"$KILN_ENGINE\""]
