# syntax=docker/dockerfile:1
#
# elastrun container image: the launcher is the entrypoint, the example training job lives in /workspace.
#
#   CPU (default):  docker build -t elastrun:0.1.0-cpu .
#   CUDA:           docker build -t elastrun:0.1.0-cuda \
#                       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 \
#                       --build-arg VARIANT=cuda .
#
# Why the CUDA variant needs no CUDA base image: PyTorch's CUDA wheels bring the CUDA runtime, cuDNN and
# NCCL with them as pip packages; only the driver comes from the host (NVIDIA container toolkit, or the
# device plugin on Kubernetes). So both variants share one small Debian base and differ only in the index
# torch is installed from. BASE_IMAGE can still be swapped (a site's own Python image), as long as it is
# Debian-based, has Python >= 3.10, and the same image is used by both stages (the venv is copied as is).
#
# Run:  docker run --rm elastrun:0.1.0-cpu --standalone --nproc-per-node=2 examples/train_imagenet_style.py
# Everything after the image name is elastrun's command line; PET_* environment variables work as well.

ARG BASE_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------------------------------------------------
# build: a virtual environment with torch (from the variant's index), elastrun and its etcd client.
FROM ${BASE_IMAGE} AS build

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_SPEC="torch>=2.3"

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:${PATH}

# torch first and in its own layer: it is nearly all of the image and changes far less often than elastrun.
RUN pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"

COPY pyproject.toml README.md /src/
COPY elastrun /src/elastrun
RUN pip install "/src[etcd]" \
    && elastrun --help > /dev/null

# ---------------------------------------------------------------------------------------------------------
# runtime: the venv, tini as PID 1, an unprivileged user. No compiler, no pip cache, no source tree.
FROM ${BASE_IMAGE} AS runtime

ARG VARIANT=cpu
LABEL org.opencontainers.image.title="elastrun" \
      org.opencontainers.image.description="Elastic launcher for PyTorch distributed training (${VARIANT})"

# tini reaps orphaned grandchildren (e.g. data-loader processes of a SIGKILLed worker) and passes SIGTERM
# from the kubelet or Docker on to elastrun, which forwards it to its workers and waits --stop-timeout.
RUN apt-get update \
    && apt-get install --yes --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 1000 --user-group elastrun

COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /workspace
COPY --chown=elastrun:elastrun examples /workspace/examples

USER elastrun
ENTRYPOINT ["/usr/bin/tini", "--", "elastrun"]
CMD ["--help"]
