# syntax=docker/dockerfile:1
# trainforge on NVIDIA GPUs: the Ray nodes of deploy/k8s/overlays/gpu (NCCL between GPUs).
#   docker build -t trainforge:0.1.0-cuda12.8 .
# torch's CUDA build brings its own CUDA libraries (cuBLAS, cuDNN, NCCL as pip packages); the
# CUDA runtime base supplies the rest of the user-space stack and the NVIDIA container toolkit's
# hooks. The node's driver must support CUDA 12.8 (driver >= 570). To build for another CUDA,
# change both CUDA_TAG and TORCH_INDEX together. The CPU image is ./Dockerfile.cpu.
# BASE_IMAGE (the runtime) and BUILD_IMAGE (the wheel's build) may name a mirror's copies of these
# images; pip's PIP_* source settings pass through as build arguments as in Dockerfile.cpu.
ARG CUDA_TAG=12.8.1-runtime-ubuntu24.04
ARG BASE_IMAGE=nvidia/cuda:${CUDA_TAG}
# checkov:skip=CKV_DOCKER_7:The base image is a build argument whose default is a pinned tag (tests/deploy/test_containers.py checks every default); checkov cannot read an argument's default.
ARG BUILD_IMAGE=python:3.11.11-slim-bookworm

# Stage 1: build trainforge's wheel (pure Python) from the source tree.
FROM ${BUILD_IMAGE} AS build
ARG PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_CERT
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN python3 -m venv /opt/build \
    && /opt/build/bin/pip install --no-cache-dir --disable-pip-version-check "pip==25.0.1" \
    && /opt/build/bin/pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# Stage 2: the CUDA runtime with Ubuntu 24.04's Python 3.12 and a virtual environment.
FROM ${BASE_IMAGE} AS runtime
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_CERT
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
