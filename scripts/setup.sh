#!/usr/bin/env bash
# Set up ANDREA in ./.venv. `--test` adds what the test suite needs.
# Idempotent: rerunning only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

extras="gpu"
if [[ "${1:-}" == "--test" ]]; then
  extras="test,kernels,slurm"
  # Headless Chromium for the dashboard's browser tests: Playwright drives Debian's build.
  if ! command -v chromium >/dev/null && command -v apt-get >/dev/null; then
    apt-get update -q && apt-get install -y -q --no-install-recommends chromium
  fi
  # A local SLURM cluster for tests/test_slurm.py (scripts/slurm_check.sh).
  if ! command -v slurmctld >/dev/null && command -v apt-get >/dev/null; then
    apt-get update -q && apt-get install -y -q slurm-wlm munge
  fi
fi

python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[${extras}]"
if [[ "${1:-}" == "--test" ]]; then
  # The export test loads the Hugging Face folder with transformers (CPU torch).
  .venv/bin/python -m pip install -q torch==2.13.0 transformers safetensors
fi
echo "andrea installed in .venv (extras: ${extras})"
