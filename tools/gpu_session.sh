#!/usr/bin/env bash
# One GPU lease's work, in one call (the lease is short: build, test and time together).
#
#   bash tools/gpu_session.sh                 # on a machine with a CUDA GPU, from the repository root
#   BUDGET_S=420 BENCH_ARGS="--workloads llama7b-layer" bash tools/gpu_session.sh
#   PYTEST_K="f8 or zero" SKIP_BENCH=1 bash tools/gpu_session.sh     # a rerun of some tests only
#   NCU=1 bash tools/gpu_session.sh          # then Nsight Compute on one launch of the step kernels (llama7b-layer)
#   TUNE=1 bash tools/gpu_session.sh         # then bench/gpu_coded_tune.py (${TUNE_ARGS}): the coded kernel's
#                                             # launch variants, e.g. the full-chunk launch against one launch
#                                             # ("n") and against its pipelined form ("p"); the fp32-state
#                                             # kernel's full-chunk launch against one launch ("s")
#   BASE=gpu_base BASE_ARGS="--modes 8bit --candidates triton" bash tools/gpu_session.sh
#                                             # then the same benchmark against a baseline copy of the package
#                                             # (a folder holding zero_kernels/ with kernels/ and csrc/ inside,
#                                             # e.g. from `git archive`), in the same lease: an A/B of a change
#
# 1. The extension (C++ + CUDA, TORCH_CUDA_ARCH_LIST, default 9.0) is JIT-built in the background while
#    2. tests/gpu runs with the Triton backend (the CUDA-backend cases skip with ZERO_KERNELS_NO_JIT=1), then
#    3. the CUDA-backend cases (and the ZeRO-on-NCCL tests, which take the fastest backend) once the build is in,
#    4. bench/gpu.py (all workloads and modes unless BENCH_ARGS says otherwise).
# Every phase is bounded by `timeout`, inside BUDGET_S seconds in all. Logs go to $OUT (or ./gpu_out):
# env.txt, build.log, tests_triton.log, tests_cuda.log, bench.log, bench.csv, junit_*.xml (8 files: the
# device tool returns at most 8), and with NCU=1 the Nsight Compute reports appended to bench.log.
# The package runs from the checkout (PYTHONPATH), against the machine's own torch and triton.
set -u
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
BUDGET_S=${BUDGET_S:-450}
END=$((SECONDS + BUDGET_S))
left() { local l=$((END - SECONDS - ${1:-0})); echo $((l > 10 ? l : 10)); }
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD
export MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/zk_torch_ext} ZERO_KERNELS_VERBOSE_BUILD=1
# the installed layout (zero_kernels.kernels, zero_kernels.csrc) from the checkout's folders
[ -e zero_kernels/kernels ] || ln -s ../kernels zero_kernels/kernels
[ -e zero_kernels/csrc ] || ln -s ../csrc zero_kernels/csrc

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  nvcc --version | tail -2
  nproc
} 2>&1 | tee "$OUT/env.txt"

# 1. the extension, in the background
( t0=$SECONDS
  timeout "$(left 200)" python3 -c "
from zero_kernels import _ext
m = _ext.cpu_module()
print('extension:', m, '| error:', _ext.load_error() or 'none')
print('has CUDA kernels:', m is not None and hasattr(m, 'fused_adam_cuda'))
"
  echo "build rc=$? in $((SECONDS - t0)) s" ) > "$OUT/build.log" 2>&1 &
BUILD=$!

PYTEST=(python3 -m pytest -q -rfEs -p no:cacheprovider --durations=15)
if python3 -c "import xdist" 2>/dev/null; then PYTEST+=(-n 8); fi
if python3 -c "import pytest_timeout" 2>/dev/null; then PYTEST+=(--timeout 180); fi

# 2. the Triton backend (and everything that does not need the extension)
t0=$SECONDS
K=${PYTEST_K:-}
ZERO_KERNELS_NO_JIT=1 timeout "$(left 200)" "${PYTEST[@]}" tests/gpu ${K:+-k "$K"} --junitxml="$OUT/junit_triton.xml" \
  > "$OUT/tests_triton.log" 2>&1
echo "tests (triton pass) rc=$? in $((SECONDS - t0)) s"; tail -3 "$OUT/tests_triton.log"
grep -E "^FAILED" "$OUT/tests_triton.log" | head -20

# 3. the CUDA backend, once built
wait $BUILD; tail -4 "$OUT/build.log"
if grep -q "error: none" "$OUT/build.log"; then
  t0=$SECONDS
  timeout "$(left 150)" "${PYTEST[@]}" tests/gpu -k "(cuda or nccl)${K:+ and ($K)}" --junitxml="$OUT/junit_cuda.xml" \
    > "$OUT/tests_cuda.log" 2>&1
  echo "tests (cuda pass) rc=$? in $((SECONDS - t0)) s"; tail -3 "$OUT/tests_cuda.log"
  grep -E "^FAILED" "$OUT/tests_cuda.log" | head -20
else
  export ZERO_KERNELS_NO_JIT=1
  grep -E "error|Error" "$OUT/build.log" | head -20
fi

# 4. the benchmark
[ -n "${SKIP_BENCH:-}" ] && exit 0
t0=$SECONDS
RESERVE=5; [ -n "${TUNE:-}" ] && RESERVE=150   # the tuning runs (4c) after the benchmark get their time
timeout "$(left $RESERVE)" python3 bench/gpu.py --csv "$OUT/bench.csv" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
echo "bench rc=$? in $((SECONDS - t0)) s"

# 4b. the baseline package (BASE), same benchmark script, appended to bench.log
if [ -n "${BASE:-}" ] && [ -d "$BASE/zero_kernels" ]; then
  t0=$SECONDS
  { echo "=== baseline $BASE: bench/gpu.py ${BASE_ARGS:-}"
    PYTHONPATH=$PWD/$BASE timeout "$(left 5)" python3 bench/gpu.py ${BASE_ARGS:-}; } > "$OUT/base.tmp" 2>&1
  echo "baseline bench rc=$? in $((SECONDS - t0)) s"; grep -E "^\|" "$OUT/base.tmp" | cut -c1-200
  cat "$OUT/base.tmp" >> "$OUT/bench.log"; rm -f "$OUT/base.tmp"
fi

# 4c. the coded kernel's launch variants (TUNE): its default variants A/B the full-chunk launch ("n": one launch;
#     "p": the full-chunk launch pipelined)
if [ -n "${TUNE:-}" ]; then
  t0=$SECONDS
  { echo "=== bench/gpu_coded_tune.py ${TUNE_ARGS:-}"
    timeout "$(left 70)" python3 bench/gpu_coded_tune.py ${TUNE_ARGS:-}
    # the fp32-state kernel's full-chunk launch (kernels/adam.py SPLIT_FULL, variant suffix "s"), both workloads
    for w in llama7b-layer gpt2-xl; do
      echo "=== bench/gpu_coded_tune.py --workload $w --modes fp32,bf16-master --variants 4x1024x4,4x1024x4s"
      timeout "$(left $([ $w = gpt2-xl ] && echo 4 || echo 35))" python3 bench/gpu_coded_tune.py --workload "$w" --modes fp32,bf16-master \
        --variants 4x1024x4,4x1024x4s
    done; } > "$OUT/tune.tmp" 2>&1
  echo "tune rc=$? in $((SECONDS - t0)) s"; grep -E "^\||FAILED" "$OUT/tune.tmp" | cut -c1-200
  cat "$OUT/tune.tmp" >> "$OUT/bench.log"; rm -f "$OUT/tune.tmp"
fi

# 5. Nsight Compute (clocks left as they are): speed of light, memory, occupancy, warp stalls of one launch
if [ -n "${NCU:-}" ] && command -v ncu > /dev/null; then
  for spec in "8bit:zero_kernels triton" "8bit:zero_kernels cuda" "bf16-master:zero_kernels triton"; do
    mode=${spec%%:*}; cand=${spec#*:}; f=$(mktemp)
    timeout "$(left 5)" ncu --clock-control none --kernel-name regex:fused_adam --launch-skip 3 --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
      --section LaunchStats python3 bench/gpu.py --workloads llama7b-layer --modes "$mode" --rounds 1 --repeats 2 \
      --candidates "$cand" > "$f" 2>&1
    echo "ncu $mode $cand rc=$?"
    grep -E "Memory Throughput|DRAM Throughput|Duration|Achieved Occupancy|Registers Per|Shared Memory Config|Stall" "$f" | head -12
    { echo "=== ncu $mode $cand"; cat "$f"; } >> "$OUT/bench.log"; rm -f "$f"
  done
fi
sed -n '/All rows/,/^=== ncu/p' "$OUT/bench.log" | grep -v '^=== ncu' | cut -c1-200
[ -s "$OUT/bench.log" ] && ! grep -q "All rows" "$OUT/bench.log" && tail -40 "$OUT/bench.log" | cut -c1-200
exit 0
