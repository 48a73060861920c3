#!/bin/bash
# Before/after benchmarks in one device call: an earlier tree and this one, on the same machine.
#
#   git archive REV | (mkdir -p .before && tar -x -C .before)    # here; .before/ is git-ignored
#   bash tools/bench/before_after.sh PART...                     # on the GPU, .whl .fijit .before carried
#
# PART: orpheus (B = 1, 16, 64, 256), orpheus2 (B = 1, 64, 256, rows appended to orpheus-rows.txt),
# vjepa (H = 30), bagel (t2i 1024^2, B = 1), qwen3 (speech B = 16, 32), tests (pytest -m gpu, this
# tree). Each bench runs from its own tree's root with that tree on PYTHONPATH, old then new; a
# log per run and summary.txt (exit code and seconds of each) land in $OUT (8 files at most:
# pick parts accordingly), and the FlashInfer kernels compiled meanwhile in $OUT/fijit.tar.
set -u
NEW=$PWD; OLD=$PWD/.before
[ -d "$OLD/runtime" ] || { echo "no earlier tree in .before (see the header)"; exit 2; }
OUT=/tmp/gc STAGES="none" bash tools/gpu_check.sh > /tmp/install.log 2>&1
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws
S=$OUT/summary.txt
run() { # name tree limit args...
  local name=$1 tree=$2 lim=$3; shift 3
  local t0=$(date +%s)
  (cd $tree && PYTHONPATH=/tmp/site:$tree:$tree/runtime:$tree/models timeout $lim python3 "$@") > $OUT/$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 ))s" >> $S
}
for part in "$@"; do
  case $part in
    orpheus) for t in old new; do tree=$([ $t = old ] && echo $OLD || echo $NEW)
      run orpheus-$t $tree 200 tools/bench/orpheus.py --skip-hf --paths cohort --batches 1,16,64,256 --tokens 128 --out /tmp/o-$t.json; done;;
    vjepa) for t in old new; do tree=$([ $t = old ] && echo $OLD || echo $NEW)
      run vjepa-$t $tree 120 tools/bench/vjepa2.py --horizons 30 --repeats 3 --no-plan --out /tmp/v-$t.json; done;;
    bagel) for t in old new; do tree=$([ $t = old ] && echo $OLD || echo $NEW)
      run bagel-$t $tree 200 tools/bench/bagel.py --skip edit,und --t2i-batches 1 --repeats 2 --skip-official --out /tmp/b-$t.json; done;;
    qwen3) for t in old new; do tree=$([ $t = old ] && echo $OLD || echo $NEW)
      run qwen3-$t $tree 260 tools/bench/qwen3_omni.py --batches 16,32 --tokens 32 --frames 128 --chat-batches "" --profile-batch 0 --skip-hf --skip-parity --out /tmp/q-$t.json; done;;
    orpheus2) for t in old new; do tree=$([ $t = old ] && echo $OLD || echo $NEW)
      run orpheus-$t $tree 200 tools/bench/orpheus.py --skip-hf --paths cohort --batches 1,64,256 --tokens 128 --out /tmp/o-$t.json
      grep "^M\*" $OUT/orpheus-$t.log | sed "s/^/$t /" >> $OUT/orpheus-rows.txt; done; rm -f $OUT/orpheus-old.log $OUT/orpheus-new.log;;
    tests) run gputests $NEW 330 -m pytest -m gpu -q -rfEs --durations=15 tests/ ;;
  esac
done
sos=(/tmp/fiws/.cache/flashinfer/*/*/cached_ops/*/*.so)
if [ -e "${sos[0]}" ]; then mkdir -p /tmp/fj; for so in "${sos[@]}"; do xz -3 -T8 -c $so > /tmp/fj/$(basename $so).xz; done; tar -C /tmp/fj -cf $OUT/fijit.tar .; fi
cat $S
