#!/usr/bin/env bash
# The two quickstart commands of the README, and CI's entry point.
#   bash tools/dev.sh demo   set up .venv, then run the main job on the bundled default
#   bash tools/dev.sh test   set up .venv, then lint and run the test suite (what CI runs)
# Set-up is idempotent: a second run reuses .venv and only reinstalls the project (seconds).
# torch comes from PyTorch's CPU wheel index where it can (see torch_args).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=.venv
TORCH_VERSION=2.13.0
# PyTorch's index of CPU-only wheels (Linux, Windows). PyPI's Linux wheel of the same version
# is the CUDA build with its multi-GB libraries. TORCH_INDEX_URL= (empty) skips it.
TORCH_INDEX_URL=${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}

# The pip arguments that install torch: from the CPU index where it applies and answers,
# else from pip's own configuration (a local mirror, find-links, or PyPI: on Linux that is
# the CUDA build). `bash tools/dev.sh torch-args` prints them (tests/test_dev_sh.py).
torch_args() {
  local why=""
  if [ "$(uname -s)" = "Darwin" ]; then
    why="macOS: PyPI's wheel is the CPU (and MPS) build"
  elif [ -z "$TORCH_INDEX_URL" ]; then
    why="TORCH_INDEX_URL is empty"
  elif ! "$PY" - "$TORCH_INDEX_URL" <<'PYCODE' 2>/dev/null; then
import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=5).close()
PYCODE
    why="$TORCH_INDEX_URL did not answer within 5 s"
  fi
  if [ -z "$why" ]; then
    echo "torch==$TORCH_VERSION --index-url $TORCH_INDEX_URL"
  else
    echo "torch==$TORCH_VERSION"
    echo "==> the CPU wheel index is not used ($why): torch comes from pip's configured index;" \
         "on Linux from PyPI that is the CUDA build (several GB; it runs on CPU too)" >&2
  fi
}

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    echo "==> creating $VENV with $($PY --version)"
    "$PY" -m venv "$VENV"
  fi
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    local args
    args=$(PY="$VENV/bin/python" torch_args)
    echo "==> pip install $args"
    # shellcheck disable=SC2086 # the arguments are words
    "$VENV/bin/pip" install -q $args
  fi
  "$VENV/bin/python" -c "import torch; print('==> torch', torch.__version__, '(CUDA ' + torch.version.cuda + ')' \
    if torch.version.cuda else '(CPU build)')"
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
  torch-args)
    torch_args
    ;;
  *)
    echo "usage: bash tools/dev.sh demo|test [pytest args]" >&2
    exit 2
    ;;
esac
