# pipeserve: one image for every process of the pipeline; compose.yaml picks the subcommand.
#   docker build -t pipeserve .
#   docker run --gpus all -p 50051:50051 -v /models/llama:/model:ro pipeserve up --model /model --host 0.0.0.0
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIPESERVE_CACHE=/home/pipeserve/.cache/pipeserve

WORKDIR /app
# Dependencies first (torch from PyPI carries its CUDA runtime), so code edits rebuild one layer.
COPY pyproject.toml ./
RUN python -c "import tomllib; d = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; \
print('\n'.join(d))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt
COPY . .
RUN pip install --no-deps . \
    && useradd --create-home --uid 1000 pipeserve
USER pipeserve

EXPOSE 50051
ENTRYPOINT ["pipeserve"]
CMD ["up", "--host", "0.0.0.0", "--port", "50051"]
