#!/usr/bin/env bash
# Installs what a fresh machine lacks, for one of two uses:
#   bash scripts/install.sh serve   what scripts/loraplex-up.sh serves with: PostgreSQL and Redis
#                                   (Debian packages), the CPU build of torch, and loraplex with
#                                   its training and tracking extras (the local worker, W&B runs)
#   bash scripts/install.sh test    all of that, plus what only the tests need: Chromium and its
#                                   driver for the dashboard's browser tests, and the dev extra
#                                   (pytest, selenium, MLflow, the OpenAI SDK, ...); run-tests.sh
# Idempotent: a second run only checks. LORAPLEX_INSTALL_PLAN=1 prints what the use needs and
# installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

USE=${1:-test}
case "$USE" in
  serve)
    APT=(postgresql redis-server)
    EXTRAS="train,tracking"
    IMPORTS="service, worker, kernels, fastapi, uvloop, httptools, orjson, transformers, peft, triton, ortools, wandb"
    ;;
  test)
    # the dashboard's browser tests run Debian's headless Chromium through its chromedriver
    APT=(postgresql redis-server chromium chromium-driver)
    EXTRAS="train,tracking,dev"
    IMPORTS="service, worker, kernels, fastapi, uvloop, httptools, orjson, transformers, peft, triton, ortools, wandb, pytest, openai, schemathesis, kubernetes_validate, selenium, mlflow, standardwebhooks"
    ;;
  *)
    echo "usage: bash scripts/install.sh serve|test" >&2
    exit 2
    ;;
esac

if [ "${LORAPLEX_INSTALL_PLAN:-0}" = 1 ]; then
  echo "install plan ($USE): apt ${APT[*]}; pip -e .[$EXTRAS]"
  exit 0
fi

have() {  # whether the Debian package's program is already here
  case "$1" in
    postgresql) ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 ;;
    chromium-driver) command -v chromedriver >/dev/null 2>&1 ;;
    *) command -v "$1" >/dev/null 2>&1 ;;
  esac
}
need_apt=()
for pkg in "${APT[@]}"; do have "$pkg" || need_apt+=("$pkg"); done
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
STAMP=.install-stamp-$USE
if ! $PY -c "import $IMPORTS" >/dev/null 2>&1 || [ pyproject.toml -nt "$STAMP" ]; then
  echo "install: pip install -e .[$EXTRAS]"
  $PY -m pip install -q -e ".[$EXTRAS]"
  touch "$STAMP"
fi
echo "install ($USE): ok"
