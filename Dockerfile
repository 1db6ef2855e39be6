# pipeserve: one image for every process of the pipeline; compose.yaml picks the subcommand.
#   docker build -t pipeserve .
#   docker run --gpus all -p 50051:50051 -v /models/llama:/model:ro pipeserve up --model /model --host 0.0.0.0
#
# Build arguments:
#   BASE           a Debian-based image (default debian:bookworm-slim; an nvidia/cuda runtime image works
#                  too: the CUDA libraries come with the torch wheel either way)
#   TORCH_VERSION  the torch the Makefile pins. From PyPI this is the CUDA build on x86-64, and it
#                  pins the Triton release it was built with, so torch and Triton always match.
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
       fi \
    && python3 -m venv /opt/venv

WORKDIR /app
# Dependencies first, torch pinned before the rest, so code edits rebuild one layer.
COPY pyproject.toml ./
RUN pip install $PIP_ARGS "torch==${TORCH_VERSION}" \
    && python -c "import tomllib; d = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; \
print('\n'.join(d))" > /tmp/requirements.txt \
    && pip install $PIP_ARGS -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt
COPY . .
RUN pip install --no-deps . \
    && useradd --create-home --uid 1000 pipeserve
USER pipeserve
# Owned by the user, so a named volume mounted here (compose.yaml's `cache`) starts out writable.
RUN mkdir -p "$PIPESERVE_CACHE"

EXPOSE 50051
ENTRYPOINT ["pipeserve"]
CMD ["up", "--host", "0.0.0.0", "--port", "50051"]
