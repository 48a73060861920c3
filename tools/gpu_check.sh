#!/usr/bin/env bash
# The GPU machine's one command: FlashInfer installed from what was carried, the GPU tests, the
# benchmarks, and everything worth keeping under $OUT. Run from the repository root with
# `.whl` and `.fijit` carried (both are git-ignored):
#
#   bash tools/gpu_check.sh
#
# Stages (each under its own time limit, so the whole script ends inside 9 minutes even on a
# fresh machine whose FlashInfer kernels still compile: 12-84 s each, reference/device.md 2c):
#   1. FlashInfer 0.7.4 + apache-tvm-ffi into /tmp/site (device.md 2b), previously compiled
#      kernels from .fijit/*.so.xz as AOT modules, lark for the compiler if the image lacks it
#      (from any .whl/**/lark-*.whl), and the project on PYTHONPATH through a link folder
#      (the source roots runtime/ and models/: no pip build, which would want the network);
#   2. pytest -m gpu (FlashInfer vs the reference, graph replay vs eager, the models' real-size
#      parity tests), with a per-test timeout;
#   3. tools/bench/orpheus.py (M* vs transformers, B = 1, 16, 64), then tools/bench/vjepa2.py;
#   4. the kernels compiled in this run, as $OUT/fijit/*.so.xz (device.md 2c): copy them into
#      .fijit/ here, and the next run compiles nothing.
# $OUT holds at most 8 files (the return limit): gpu_check.log (everything printed),
# orpheus.json, vjepa2.json and up to 5 kernel files (more are bundled into fijit/fijit.tar).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/out/gpu}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
TEE_PID=$!
export PYTHONUNBUFFERED=1
START=$(date +%s)
stage() { echo; echo "==> [$(( $(date +%s) - START )) s] $*"; }
# gpu_tests 'GLOB': a stage running `pytest -m gpu` over the test files GLOB names; a failure marks the run failed
gpu_tests() {
  stage "pytest -m gpu $1"
  # shellcheck disable=SC2086 # GLOB expands here
  timeout 200 $PY -m pytest -m gpu -q -rfEs --durations=10 $1
  rc=$?; echo "pytest exit code $rc"; [ $rc -eq 0 ] || STATUS=1
}
PY=python3
STATUS=0
# benchmark arguments (overridable, e.g. for a dry run of this script on a CPU)
ORPHEUS_ARGS=${ORPHEUS_ARGS:---tokens 128 --batches 1,16,64 --budget-s 260}
VJEPA2_ARGS=${VJEPA2_ARGS:---repeats 3}

save_kernels() {
  # Only what this run compiled lands in the JIT cache; kernels loaded from .fijit are AOT modules.
  local sos=(/tmp/fiws/.cache/flashinfer/*/*/cached_ops/*/*.so)
  rm -f "$OUT"/*.tmp  # a benchmark killed mid-write leaves one; it must not take a file slot
  [ -e "${sos[0]}" ] || { echo "no newly compiled FlashInfer kernels to save"; return; }
  mkdir -p "$OUT/fijit"
  local tops; tops=$(find "$OUT" -maxdepth 1 -type f | wc -l)
  local slots=$(( 8 - tops - 1 ))  # the log may still grow a little, never into a new file
  local stage_dir=/tmp/fijit-out; rm -rf "$stage_dir"; mkdir -p "$stage_dir"
  for so in "${sos[@]}"; do xz -3 -T8 -c "$so" > "$stage_dir/$(basename "$so").xz"; done
  if [ "${#sos[@]}" -le "$slots" ]; then
    cp "$stage_dir"/*.so.xz "$OUT/fijit/"
  else
    tar -C "$stage_dir" -cf "$OUT/fijit/fijit.tar" .  # unpack into .fijit/: tar -xf fijit.tar -C .fijit
  fi
  echo "saved ${#sos[@]} compiled kernel(s) under $OUT/fijit: copy them into .fijit/ for the next run"
  ls -la "$OUT/fijit"
}
finish() {
  save_kernels
  exec >&- 2>&-  # let tee see the end of its input, and wait for it: the log must be complete
  wait "$TEE_PID" 2>/dev/null || true
}
trap finish EXIT

# ---------------------------------------------------------------------------- 1. install
stage "install FlashInfer, lark and the project"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
mkdir -p /tmp/site /tmp/fiws
if [ -s .whl/fi-0.7.4.tar.xz ] && ls .whl/apache_tvm_ffi-*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/apache_tvm_ffi-*.whl \
    && tar -xJf .whl/fi-0.7.4.tar.xz -C /tmp/site || { echo "FlashInfer install FAILED"; STATUS=1; }
  if [ -f .fijit/fijit.tar ]; then tar -xf .fijit/fijit.tar -C .fijit; fi
  n=0
  for f in .fijit/*.so.xz; do
    [ -f "$f" ] || continue
    b=$(basename "$f" .so.xz); mkdir -p "/tmp/site/flashinfer/data/aot/$b"
    xz -dc "$f" > "/tmp/site/flashinfer/data/aot/$b/$b.so"; n=$((n + 1))
  done
  echo "FlashInfer unpacked; $n precompiled kernel(s) installed from .fijit"
else
  echo "NO FlashInfer: .whl/fi-0.7.4.tar.xz or .whl/apache_tvm_ffi-*.whl missing (device.md 2a; carry .whl)"
  STATUS=1
fi
if ! $PY -c "import lark" 2>/dev/null; then
  lark_whl=$(find .whl -name 'lark-*.whl' 2>/dev/null | sort | tail -n 1)
  if [ -n "$lark_whl" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$lark_whl"
  else
    echo "lark is missing and no .whl/**/lark-*.whl was carried: the compiler (mstarc) cannot run"; STATUS=1
  fi
fi
# the source roots pyproject names: the repository (mstarc), runtime/ (mstar_runtime), models/ (mstar_models)
export PYTHONPATH=/tmp/site:$ROOT:$ROOT/runtime:$ROOT/models${PYTHONPATH:+:$PYTHONPATH}
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws
$PY - <<'EOF' || STATUS=1
import time, torch
t = time.perf_counter()
try:
    import flashinfer
    print(f"flashinfer {flashinfer.__version__} imports ({time.perf_counter() - t:.1f} s)")
except Exception as e:
    print(f"flashinfer does NOT import: {type(e).__name__}: {e}")
import mstar_runtime, mstar_models, mstarc  # noqa: F401
print(f"torch {torch.__version__}, cuda {torch.version.cuda}, {torch.cuda.get_device_name(0)}; mstar imports")
EOF

# STAGES picks what runs after the install, in this order (default: "tests bench"):
#   profile  tools/bench/profile_orpheus.py (a host profile and a device timeline of the decode loop)
#            at each batch size of PROFILE_BATCHES (default 16; B or B:path, path cohort or generic),
#            into $OUT/profile-b<B>-<path>.txt
#   probes   tools/probes/sampler_parts.py --rows 1 64 256 (the sampling stage, fused and torch,
#            eager and captured; $OUT/sampler_parts.json) and tools/probes/prefix_hit_miss.py
#            (Orpheus' prefix-cache hit against its miss and no cache, bits and times, with the
#            kernel tables of each mode; $OUT/prefix_probe/), 90 + 150 s at most
#   tests    pytest -m gpu
#   bench    tools/bench/orpheus.py, then tools/bench/vjepa2.py if time is left
#   orpheus  tools/bench/orpheus.py only
#   fp8      pytest -m gpu on tests/test_gpu_fp8.py and tests/test_fp8.py, then tools/bench/orpheus.py
#            at FP8_BATCHES (default 1,16,64; 128 tokens, cohort path, no HF) twice: bf16
#            ($OUT/orpheus_bf16.json), then --fp8 with the parity figure ($OUT/orpheus_fp8.json)
#   bagel    pytest -m gpu on tests/test_bagel_*.py, then tools/bench/bagel.py $BAGEL_ARGS
#            (the official inferencer too when `.official/` was carried: tools/official_bagel.sh)
#   qwen3    pytest -m gpu on tests/test_qwen3_omni_*.py, then tools/bench/qwen3_omni.py $QWEN3_ARGS
#            (real size, dummy weights: speech at B = 1, 4, 16, 32, chat, transformers at B = 1 on the
#            same weights, the HBM floors; into $OUT/qwen3_omni.json)
#   serve    issue 17 section 0/4: Orpheus (`bench` variant, end check off: 128 tokens per
#            request) in process (tools/bench/orpheus.py: lockstep batches, and a closed loop at
#            SERVE_CLOSED_LOOP, default 16,64; $OUT/orpheus_inproc.json), then over
#            HTTP with tools/bench/serve.py at SERVE_CONCURRENCY (default 1,16,64,256) against
#            `mstar-run --serve`, the engine in the server's process and with --engine-process
#            ($OUT/serve_inproc.json, serve_engine.json; the servers' log tails in the log). The server's
#            packages (fastapi, uvicorn, pydantic, python-multipart) come from .whl/serve/*.whl
#            (`pip download` them for cp312 here: the image lacks them).
#   multigpu on a machine with 2+ GPUs: pytest -m multigpu (unless MULTIGPU_TESTS=0), then Orpheus
#            for each placement of MULTIGPU_PLACEMENTS (default: tp 1, tp 2 and the split;
#            orpheus-<placement>.json each)
#   probe    on 2+ GPUs: tools/probes/nccl_teardown.py, each way of ending a NCCL group whose
#            all-reduce a CUDA graph captured
# e.g. `STAGES="profile orpheus" bash tools/gpu_check.sh`.
STAGES=" ${STAGES:-tests bench} "
if [[ "$STAGES" == *" profile "* ]]; then
  for pb in ${PROFILE_BATCHES:-16}; do
    b=${pb%%:*}; path=${pb#*:}; [ "$path" = "$pb" ] && path=cohort  # B or B:path (cohort | generic)
    stage "tools/bench/profile_orpheus.py --batch $b --path $path"
    timeout 200 $PY tools/bench/profile_orpheus.py --batch "$b" --path "$path" --out "$OUT/profile-b$b-$path.txt" > /dev/null
    rc=$?; echo "profile exit code $rc"; [ $rc -eq 0 ] || STATUS=1
    head -4 "$OUT/profile-b$b-$path.txt" 2>/dev/null
  done
fi

if [[ "$STAGES" == *" probes "* ]]; then
  stage "tools/probes/sampler_parts.py --rows 1 64 256"
  timeout 90 $PY tools/probes/sampler_parts.py --rows 1 64 256
  rc=$?; echo "sampler probe exit code $rc"; [ $rc -eq 0 ] || STATUS=1
  stage "tools/probes/prefix_hit_miss.py --device cuda"
  timeout 150 $PY tools/probes/prefix_hit_miss.py --device cuda --out "$OUT/prefix_probe"
  rc=$?; echo "prefix probe exit code $rc"; [ $rc -eq 0 ] || STATUS=1
fi

# ---------------------------------------------------------------------------- 2. GPU tests
if [[ "$STAGES" == *" tests "* ]]; then
  stage "pytest -m gpu"
  TIMEOUT_FLAG=""
  $PY -c "import pytest_timeout" 2>/dev/null && TIMEOUT_FLAG="--timeout=170"
  timeout 240 $PY -m pytest -m gpu -q -rfEs --durations=15 --continue-on-collection-errors $TIMEOUT_FLAG tests/
  rc=$?; echo "pytest exit code $rc"; [ $rc -eq 0 ] || STATUS=1
fi

# ---------------------------------------------------------------------------- 3. benchmarks
if [[ "$STAGES" == *" bench "* || "$STAGES" == *" orpheus "* ]]; then
  stage "tools/bench/orpheus.py"
  left=$(( 540 - ($(date +%s) - START) ))
  # shellcheck disable=SC2086  # word splitting of the argument lists is intended
  timeout $(( left < 300 ? left : 300 )) $PY tools/bench/orpheus.py $ORPHEUS_ARGS --out "$OUT/orpheus.json"
  rc=$?; echo "orpheus bench exit code $rc"; [ $rc -eq 0 ] || STATUS=1
fi

if [[ "$STAGES" == *" fp8 "* ]]; then
  stage "pytest -m gpu tests/test_gpu_fp8.py tests/test_fp8.py"
  timeout 200 $PY -m pytest -m "gpu or not gpu" -q -rfEs tests/test_gpu_fp8.py tests/test_fp8.py
  rc=$?; echo "fp8 tests exit code $rc"; [ $rc -eq 0 ] || STATUS=1
  for w in bf16 fp8; do
    stage "tools/bench/orpheus.py ($w)"
    flag=""; [ "$w" = fp8 ] && flag="--fp8"
    left=$(( 540 - ($(date +%s) - START) )); [ "$w" = bf16 ] && left=$(( left / 2 ))  # half each
    # shellcheck disable=SC2086
    timeout $(( left > 60 ? left : 60 )) $PY tools/bench/orpheus.py --skip-hf --paths cohort --tokens 128 --batches "${FP8_BATCHES:-1,16,64}" \
      $flag --out "$OUT/orpheus_$w.json"
    rc=$?; echo "orpheus $w bench exit code $rc"; [ $rc -eq 0 ] || STATUS=1
  done
fi

if [[ "$STAGES" == *" bench "* ]] && [ -f tools/bench/vjepa2.py ]; then
  stage "tools/bench/vjepa2.py"
  left=$(( 525 - ($(date +%s) - START) ))
  if [ $left -gt 30 ]; then
    # shellcheck disable=SC2086
    timeout $left $PY tools/bench/vjepa2.py $VJEPA2_ARGS --out "$OUT/vjepa2.json"
    rc=$?; echo "vjepa2 bench exit code $rc"; [ $rc -eq 0 ] || STATUS=1
  else
    echo "skipped: only $left s left of the 9-minute budget"
  fi
fi

if [[ "$STAGES" == *" bagel "* ]]; then
  gpu_tests 'tests/test_bagel_*.py'
  stage "tools/bench/bagel.py"
  left=$(( 560 - ($(date +%s) - START) ))
  # shellcheck disable=SC2086
  timeout $left $PY tools/bench/bagel.py ${BAGEL_ARGS:-} --out "$OUT/bagel.json"
  rc=$?; echo "bagel bench exit code $rc"; [ $rc -eq 0 ] || STATUS=1
fi

if [[ "$STAGES" == *" qwen3 "* ]]; then
  gpu_tests 'tests/test_qwen3_omni_*.py'
  stage "tools/bench/qwen3_omni.py"
  left=$(( 560 - ($(date +%s) - START) ))
  # the transformers baseline runs last and is skipped (recorded) when it would not end in time;
  # QWEN3_ARGS may set its own --budget-s (the last one given counts)
  if [ $left -gt 60 ]; then
    # shellcheck disable=SC2086
    timeout $left $PY tools/bench/qwen3_omni.py --budget-s $(( left - 20 )) ${QWEN3_ARGS:-} --out "$OUT/qwen3_omni.json"
    rc=$?; echo "qwen3_omni bench exit code $rc"; [ $rc -eq 0 ] || STATUS=1
  else
    echo "skipped: only $left s left of the 9-minute budget"; STATUS=1
  fi
fi

if [[ "$STAGES" == *" serve "* ]]; then
  stage "serve: Orpheus in process, then over HTTP (engine in the server's process, then in its own)"
  if ls .whl/serve/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/serve/*.whl
  fi
  sed -E 's/(end_of_speech *= *)[0-9]+/\12000000000/' models/orpheus/orpheus.walk > /tmp/orpheus_fixed.walk
  $PY -m mstarc.cli compile /tmp/orpheus_fixed.walk --variant bench -p placements/h200x1.yaml -o /tmp/orpheus.plan \
    || STATUS=1
  timeout 200 $PY tools/bench/orpheus.py --skip-hf --paths cohort --batches "${SERVE_BATCHES:-1,16,64}" --tokens 128 \
    --closed-loop "${SERVE_CLOSED_LOOP:-16,64}" --out "$OUT/orpheus_inproc.json"
  rc=$?; echo "orpheus in-process exit code $rc"; [ $rc -eq 0 ] || STATUS=1
  for mode in inproc engine; do
    flag=""; [ "$mode" = engine ] && flag="--engine-process"
    left=$(( 560 - ($(date +%s) - START) ))
    [ $left -gt 60 ] || { echo "serve $mode skipped: only $left s left"; STATUS=1; continue; }
    # shellcheck disable=SC2086
    $PY -m mstar_runtime.cli /tmp/orpheus.plan --serve --port 8000 --weights dummy --device cuda --no-access-log \
      $flag > "/tmp/server_$mode.log" 2>&1 &
    spid=$!
    up=0
    for _ in $(seq 1 120); do
      if $PY -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:8000/health', timeout=1).status_code != 200)" \
        2>/dev/null; then up=1; break; fi
      kill -0 $spid 2>/dev/null || break
      sleep 1
    done
    if [ $up -eq 1 ]; then
      timeout $(( left - 20 )) $PY tools/bench/serve.py --base-url http://127.0.0.1:8000 --model orpheus \
        --workload speech --concurrency "${SERVE_CONCURRENCY:-1,16,64,256}" --warmup 16 --max-tokens 128 \
        --scrape-metrics --out "$OUT/serve_$mode.json"
      rc=$?; echo "serve.py ($mode) exit code $rc"; [ $rc -eq 0 ] || STATUS=1
    else
      echo "server ($mode) did not come up"; STATUS=1
    fi
    kill -TERM $spid 2>/dev/null; wait $spid 2>/dev/null
    echo "server ($mode) log, last lines:"; tail -n 15 "/tmp/server_$mode.log"
  done
fi

# ---------------------------------------------------------------------------- 4. several GPUs
if [[ "$STAGES" == *" probe "* ]]; then
  for mode in destroy release-destroy abort release-abort; do
    stage "tools/probes/nccl_teardown.py --mode $mode"
    timeout 45 $PY -m torch.distributed.run --nproc-per-node 2 tools/probes/nccl_teardown.py --mode "$mode" 2>&1 \
      | grep -v "^W\|OMP_NUM_THREADS\|\*\*\*\*"
    echo "probe ($mode) exit code ${PIPESTATUS[0]}"
  done
fi

# Issue "multi-GPU runs": the 2-GPU tests, then Orpheus at batch 16 and 64 for tp 1 (one GPU),
# tp 2 and the split placement (backbone on GPU 0, SNAC on GPU 1), one JSON each.
if [[ "$STAGES" == *" multigpu "* ]]; then
  if [ "${MULTIGPU_TESTS:-1}" = 1 ]; then
    stage "pytest -m multigpu"
    timeout 150 $PY -m pytest -m multigpu -q -rfEs tests/
    rc=$?; echo "pytest exit code $rc"; [ $rc -eq 0 ] || STATUS=1
  fi
  for pl in ${MULTIGPU_PLACEMENTS:-h200x1 h200x2_tp2 h200x2_split}; do
    [ "$pl" = none ] && continue
    stage "tools/bench/orpheus.py --placement placements/$pl.yaml"
    left=$(( 570 - ($(date +%s) - START) ))
    [ $left -gt 30 ] || { echo "skipped: only $left s left"; continue; }
    timeout $(( left < 150 ? left : 150 )) $PY tools/bench/orpheus.py --tokens 128 --batches 16,64 --skip-hf \
      --placement "placements/$pl.yaml" --out "$OUT/orpheus-$pl.json"
    rc=$?; echo "orpheus bench ($pl) exit code $rc"; [ $rc -eq 0 ] || STATUS=1
  done
fi

stage "done (status $STATUS)"
exit $STATUS
