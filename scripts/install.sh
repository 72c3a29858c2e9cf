#!/usr/bin/env bash
# Installs everything a fresh machine lacks: PostgreSQL and Redis servers and Chromium (Debian packages),
# the CPU build of torch on disk, and loraplex with its training and test extras.
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need_apt+=(postgresql)
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
# the dashboard's browser tests run Debian's headless Chromium through its chromedriver
command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)
command -v chromedriver >/dev/null 2>&1 || need_apt+=(chromium-driver)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "install: apt-get install ${need_apt[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
  # The Debian package starts a system cluster and redis; we run our own private ones.
  $SUDO service postgresql stop >/dev/null 2>&1 || true
  $SUDO service redis-server stop >/dev/null 2>&1 || true
fi

PY=${PYTHON:-python3}
if ! $PY -c "import torch" >/dev/null 2>&1; then
  echo "install: torch==2.13.0 (CPU wheel)"
  $PY -m pip install -q torch==2.13.0
fi
if ! $PY -c "import service, worker, kernels, fastapi, uvloop, httptools, orjson, transformers, peft, triton, ortools, pytest, openai, schemathesis, selenium, mlflow, wandb" >/dev/null 2>&1 \
   || [ pyproject.toml -nt .install-stamp ]; then
  echo "install: pip install -e .[train,dev]"
  $PY -m pip install -q -e ".[train,dev]"
  touch .install-stamp
fi
echo "install: ok"
