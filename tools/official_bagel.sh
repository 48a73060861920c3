#!/usr/bin/env bash
# Prepares .official/ (git-ignored, never committed): the official BAGEL code
# (ByteDance-Seed/Bagel) and the transformers 4.49 stack it pins, for
# tools/bench/bagel_official.py and tests/test_bagel_official.py.
#
#   tools/official_bagel.sh            make (or remake) .official/, then check it
#   tools/official_bagel.sh --check    check an existing .official/ only
#
# Layout:
#   .official/Bagel/  modeling/, data/, inferencer.py, LICENSE and requirements.txt of the
#                     snapshot; COMMIT holds its commit id
#   .official/site/   transformers==4.49.0, huggingface_hub==0.29.1, tokenizers<0.22 and
#                     einops==0.8.1 (the official pin; the FLUX AE imports it), fetched with
#                     `pip download --python-version 3.12 --platform manylinux2014_x86_64
#                     --only-binary=:all:` (the GPU machine: CPython 3.12, no network) and
#                     unpacked as `pip install --target` would lay them out. They are
#                     py3-none-any and cp39-abi3 wheels, so the same folder imports under this
#                     machine's Python 3.11: the check below proves it on both when it can.
# transformers/models/ is pruned to `auto` (the official code imports no transformers model;
# the folder is 41 of the package's 48 MB), which keeps .official/ near 25 MiB: it travels to
# the GPU as one `carry` path. The harness puts .official/site and .official/Bagel first on
# sys.path itself (bagel_official.setup), nothing has to be installed there.
#
# Env: BAGEL_SRC   a bare git dir or a checkout of ByteDance-Seed/Bagel
#                  (default /work/.mirror/ByteDance-Seed+Bagel/repo)
#      BAGEL_REV   the commit to extract (default HEAD)
#      PYTHON      the interpreter that runs pip and the check (default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
DEST=$ROOT/.official
SRC=${BAGEL_SRC:-/work/.mirror/ByteDance-Seed+Bagel/repo}
REV=${BAGEL_REV:-HEAD}
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
PACKAGES=(transformers==4.49.0 huggingface_hub==0.29.1 'tokenizers<0.22' einops==0.8.1)
PATHS=(modeling data inferencer.py LICENSE requirements.txt)
BUDGET_MIB=40

check() {
  echo "==> checking .official/ with $("$PY" --version 2>&1)"
  PYTHONDONTWRITEBYTECODE=1 "$PY" tools/bench/bagel_official.py check
  local mib
  mib=$(du -sm "$DEST" | cut -f1)
  echo "==> .official/ is ${mib} MiB (budget ${BUDGET_MIB} MiB, it travels as a carry path)"
  [ "$mib" -le "$BUDGET_MIB" ] || { echo "error: .official/ is over ${BUDGET_MIB} MiB" >&2; exit 1; }
  git check-ignore -q .official/ || { echo "error: .official/ is not git-ignored (.gitignore: /.official/)" >&2; exit 1; }
}

if [ "${1:-}" = "--check" ]; then
  check
  exit 0
fi

git check-ignore -q .official/ || { echo "error: add /.official/ to .gitignore first" >&2; exit 1; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
rm -rf "$DEST"
mkdir -p "$DEST/Bagel" "$DEST/site"

echo "==> extracting ByteDance-Seed/Bagel $REV from $SRC (${PATHS[*]})"
git -C "$SRC" archive "$REV" "${PATHS[@]}" | tar -x -C "$DEST/Bagel"
git -C "$SRC" rev-parse "$REV" > "$DEST/Bagel/COMMIT"

echo "==> pip download --python-version 3.12 --platform manylinux2014_x86_64 --only-binary=:all: ${PACKAGES[*]}"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 -d "$TMP/wheels" "${PACKAGES[@]}"
for whl in "$TMP"/wheels/*.whl; do
  case "$(basename "$whl")" in
    *-py3-none-any.whl|*-abi3-*.whl) ;;
    *) echo "error: $(basename "$whl") is neither pure nor abi3: it would not import here and there" >&2; exit 1 ;;
  esac
  "$PY" -m zipfile -e "$whl" "$DEST/site"  # a wheel's install is its unpacked tree (no scripts needed)
done

echo "==> pruning transformers/models/ to auto"
models=$DEST/site/transformers/models
find "$models" -mindepth 1 -maxdepth 1 -type d ! -name auto -exec rm -rf {} +
cat > "$models/__init__.py" <<'EOF'
# Pruned by tools/official_bagel.sh: the official BAGEL code imports no transformers model.
from . import auto
EOF
find "$DEST" -name __pycache__ -type d -prune -exec rm -rf {} +

check
