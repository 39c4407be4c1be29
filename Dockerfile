# syntax=docker/dockerfile:1
# trainforge on NVIDIA GPUs: the Ray nodes of deploy/k8s/overlays/gpu (NCCL between GPUs).
#   docker build -t trainforge:0.1.0-cuda12.8 .
# torch's CUDA build brings its own CUDA libraries (cuBLAS, cuDNN, NCCL as pip packages); the
# CUDA runtime base supplies the rest of the user-space stack and the NVIDIA container toolkit's
# hooks. The node's driver must support CUDA 12.8 (driver >= 570). To build for another CUDA,
# change both CUDA_TAG and TORCH_INDEX together. The CPU image is ./Dockerfile.cpu.
ARG CUDA_TAG=12.8.1-runtime-ubuntu24.04

# Stage 1: build trainforge's wheel (pure Python) from the source tree.
FROM python:3.11.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install --no-cache-dir --disable-pip-version-check "pip==25.0.1" \
    && pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# Stage 2: the CUDA runtime with Ubuntu 24.04's Python 3.12 and a virtual environment.
FROM nvidia/cuda:${CUDA_TAG} AS runtime
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ENV DEBIAN_FRONTEND=noninteractive \
    VIRTUAL_ENV=/opt/trainforge \
    PATH=/opt/trainforge/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12=3.12.3-* python3.12-venv=3.12.3-* \
    && rm -rf /var/lib/apt/lists/*
# UID/GID 10001: the manifests' runAsUser/fsGroup (deploy/k8s), as in the CPU image.
RUN groupadd --gid 10001 trainforge \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/trainforge --shell /bin/bash trainforge
COPY --from=build /wheels /tmp/wheels
COPY deploy/docker/constraints.txt /tmp/constraints.txt
RUN python3.12 -m venv /opt/trainforge \
    && pip install --index-url "${TORCH_INDEX}" "torch==2.13.0" \
    && pip install -c /tmp/constraints.txt /tmp/wheels/trainforge-*.whl \
    && rm -rf /tmp/wheels /tmp/constraints.txt \
    && trainforge --version
USER 10001:10001
WORKDIR /home/trainforge
# checkov:skip=CKV_DOCKER_2:The image runs as a Ray head, a Ray worker or a job submitter, each with its own health; Kubernetes ignores HEALTHCHECK and uses the probes in deploy/k8s/base/raycluster.yaml.
CMD ["trainforge", "--help"]
