# syntax=docker/dockerfile:1
# kvwatch image: the agent and nothing else (no compiler, no pip in the final stage).
#   docker build -t kvwatch:0.1.0 .
#   docker run --rm --runtime=nvidia --gpus all -e NVIDIA_DRIVER_CAPABILITIES=utility \
#     -v /etc/kvwatch:/etc/kvwatch:ro -p 9477:9477 kvwatch:0.1.0
#   docker run --rm -p 9477:9477 kvwatch:0.1.0 demo --listen 0.0.0.0:9477      # no GPU needed
# libnvidia-ml.so.1 is not in the image: the NVIDIA container runtime mounts the host driver's copy.
# For reproducible builds pin the base by digest: --build-arg PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:...
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvwatch ./kvwatch
# A self-contained virtual environment; every dependency ships a manylinux wheel, so no compiler.
RUN python -m venv /opt/kvwatch \
 && /opt/kvwatch/bin/pip install ".[fast]" \
 && /opt/kvwatch/bin/pip uninstall --yes pip setuptools wheel

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="kvwatch" \
      org.opencontainers.image.description="KV-cache and per-output-length-band latency monitoring for LLM inference nodes" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/kvwatch /opt/kvwatch
ENV PATH=/opt/kvwatch/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=utility
# nobody:nogroup. Works with a read-only root filesystem (docs/deploy.md#docker).
USER 65534:65534
EXPOSE 9477
# No curl in a slim image: ask the agent's health route with the interpreter it already has.
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9477/-/healthy', timeout=4)"]
ENTRYPOINT ["kvwatch"]
CMD ["run", "--config", "/etc/kvwatch/kvwatch.yaml"]
