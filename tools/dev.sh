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
  echo "==> installing mstar (editable) with its runtime, serve and dev extras"
  "$VENV/bin/pip" install -q -e ".[runtime,serve,dev]"
}

case "${1:-}" in
  demo)
    setup
    mkdir -p out
    echo "==> mstarc compile models/orpheus/orpheus.walk --variant tiny -p placements/cpu.yaml -o out/orpheus-tiny.plan"
    "$VENV/bin/mstarc" compile models/orpheus/orpheus.walk --variant tiny -p placements/cpu.yaml -o out/orpheus-tiny.plan
    echo "==> mstar-run out/orpheus-tiny.plan --walk tts --input text=... --input voice=tara --out out/"
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$VENV/bin/mstar-run" out/orpheus-tiny.plan --walk tts \
      --input "text=Hello from M star, a serving system for composite multimodal models." \
      --input voice=tara --input max_tokens=400 --out out/
    cat <<'MSG'

Wrote out/tts.audio.wav (24 kHz mono), spoken by the tiny Orpheus variant with RANDOM
weights: it is noise shaped like speech tokens, not speech. For real speech, put the
released checkpoints in a folder -- canopylabs/orpheus-3b-0.1-ft (safetensors, config.json,
tokenizer.json) with the SNAC 24 kHz codec converted into its snac/ sub-folder by
`python tools/convert_snac.py SNAC_DIR WEIGHTS/snac` -- and run:
  .venv/bin/mstarc compile models/orpheus/orpheus.walk -p placements/h200x1.yaml --weights WEIGHTS -o out/orpheus.plan
  .venv/bin/mstar-run out/orpheus.plan --weights WEIGHTS --walk tts --input text="..." --out out/
`mstarc explain out/orpheus-tiny.plan` shows what the plan holds.
MSG
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
