#!/usr/bin/env bash
# The two quickstart commands of the README, and CI's entry point.
#   bash tools/dev.sh demo   set up .venv, then run the main job on the bundled default
#   bash tools/dev.sh test   set up .venv, then lint and run the test suite (what CI runs)
# Set-up is idempotent: a second run reuses .venv and only reinstalls the project (seconds).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=.venv

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    echo "==> creating $VENV with $($PY --version)"
    "$PY" -m venv "$VENV"
  fi
  # torch is pinned to the CPU build: an unpinned `torch` pulls a multi-GB CUDA build.
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    echo "==> installing torch 2.13.0 (CPU build)"
    "$VENV/bin/pip" install -q torch==2.13.0
  fi
  echo "==> installing mstar (editable) with its runtime and dev extras"
  "$VENV/bin/pip" install -q -e ".[runtime,dev]"
}

case "${1:-}" in
  demo)
    setup
    mkdir -p out
    echo "==> mstarc compile models/orpheus/orpheus.walk --variant tiny -p placements/cpu.yaml -o out/orpheus-tiny.plan"
    "$VENV/bin/mstarc" compile models/orpheus/orpheus.walk --variant tiny -p placements/cpu.yaml -o out/orpheus-tiny.plan
    echo "==> mstarc explain out/orpheus-tiny.plan"
    "$VENV/bin/mstarc" explain out/orpheus-tiny.plan
    ;;
  test)
    setup
    shift
    echo "==> ruff check ."
    "$VENV/bin/ruff" check .
    echo "==> pytest"
    "$VENV/bin/python" -m pytest -q "$@"
    ;;
  *)
    echo "usage: bash tools/dev.sh demo|test [pytest args]" >&2
    exit 2
    ;;
esac
