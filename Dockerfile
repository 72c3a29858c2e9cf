# loraplex images. `api`: the FastAPI service (no torch). `worker`: the GPU node daemon with the
# training extra (CUDA torch from PyPI). Build: docker build --target api -t loraplex-api .
FROM python:3.11-slim AS base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY pyproject.toml README.md alembic.ini openapi.yaml ./
COPY contract ./contract
COPY service ./service
COPY worker ./worker
COPY trainer ./trainer
COPY kernels ./kernels
COPY migrations ./migrations

FROM base AS api
# [tracking]: wandb, with which the API writes tasks' W&B runs (offline, under /data/wandb)
RUN pip install ".[tracking]"
RUN useradd --system --home /app loraplex && mkdir -p /data && chown loraplex /data
USER loraplex
ENV LORAPLEX_STORAGE_DIR=/data/storage LORAPLEX_MODELS_FILE=/etc/loraplex/models.yaml \
    LORAPLEX_WANDB_DIR=/data/wandb
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz')"
# Migrations run first so a fresh database works; they are a no-op when already at head. Then
# uvicorn with LORAPLEX_API_WORKERS processes (default from the container's CPU quota), one of
# which leads the background loops (service.api.serve, service.core.leader).
CMD ["sh", "-c", "python -m service.admin migrate && exec python -m service.api.serve --host 0.0.0.0 --port 8000 --proxy-headers"]

FROM base AS worker
RUN pip install ".[train]"
ENV LORAPLEX_WORK_DIR=/data/worker
CMD ["python", "-m", "worker.daemon"]
