# pipeserve: one image for every process of the pipeline; compose.yaml picks the subcommand.
#   docker build -t pipeserve .
#   docker run --gpus all -p 50051:50051 -p 8000:8000 -v /models/llama:/model:ro pipeserve \
#     up --model /model --host 0.0.0.0
# (gRPC on 50051, the OpenAI-compatible HTTP API on 8000.)
#
# Dependencies are installed by tools/install.py, the Makefile's rule: a torch the base image already
# has (an NVIDIA PyTorch container's CUDA build) is kept, with its Triton, and never upgraded; the
# venv then sees it (--system-site-packages). Only a base without torch gets TORCH_VERSION. With a
# wheelhouse/ in the build context (`make wheelhouse PYTHON_VERSION=<the image's Python>`), every
# other package comes from it, offline.
#
# Build arguments:
#   BASE           a Debian- or Ubuntu-based image (default debian:bookworm-slim; an nvidia/cuda runtime
#                  image works too: the CUDA libraries come with the torch wheel; an NVIDIA PyTorch
#                  image keeps its own torch)
#   TORCH_VERSION  the torch installed when the base has none: the Makefile's. From PyPI this is the
#                  CUDA build on x86-64, and it pins the Triton release it was built with.
#   PIP_ARGS       extra pip options, e.g. "--find-links DIR" where a CPU torch wheel lies (the CPU
#                  image of compose.cpu.yaml), or a private index
#   EXTRA_CA_CERTS PEM certificates to trust besides Debian's (a TLS-intercepting proxy's CA), e.g.
#                  --build-arg EXTRA_CA_CERTS="$(cat /usr/local/share/ca-certificates/*.crt)"
ARG BASE=debian:bookworm-slim
FROM ${BASE}

ARG TORCH_VERSION=2.13.0
ARG PIP_ARGS=""
ARG EXTRA_CA_CERTS=""

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    PIPESERVE_CACHE=/home/pipeserve/.cache/pipeserve

# A C and C++ compiler, libc and Python's headers: Triton compiles a small C driver the first time it
# launches a kernel; on the CPU, Inductor builds the compiled decode steps in C++ and the engine its
# native kernels (pipeserve/engine/backend/native.py). Without g++ a CPU engine runs eager torch ops.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc g++ libc6-dev ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && if [ -n "$EXTRA_CA_CERTS" ]; then \
         printf '%s\n' "$EXTRA_CA_CERTS" > /usr/local/share/ca-certificates/extra.crt && update-ca-certificates; \
       fi

WORKDIR /app
# Dependencies first, so code edits rebuild one layer. The wheelhouse, when there is one, is copied
# beside install.py (the pattern matches nothing when there is none; install.py looks for wheels).
COPY pyproject.toml ./
COPY tools/install.py wheelhous[e] tools/
RUN /usr/bin/python3 tools/install.py venv /opt/venv --deps-only --torch-version "${TORCH_VERSION}" \
        --wheelhouse tools --pip-args "$PIP_ARGS"
COPY . .
RUN pip install --no-deps . \
    && useradd --create-home --uid 1000 pipeserve
USER pipeserve
# Owned by the user, so a named volume mounted here (compose.yaml's `cache`) starts out writable.
RUN mkdir -p "$PIPESERVE_CACHE"

EXPOSE 50051 8000
ENTRYPOINT ["pipeserve"]
CMD ["up", "--host", "0.0.0.0", "--port", "50051"]
