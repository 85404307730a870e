#!/usr/bin/env bash
# Runs every GPU test and benchmark in one call and writes logs and results under $OUT (default ./gpu-out).
#
#   scripts/gpu_suite.sh [stage ...]      (no stage: all of them)
#
# Stages: info, tests, bench-dispatch, bench-low-latency, bench-p2p, bench-allgather, demo
# Environment: TESTS (paths), TEST_FILTER (a pytest -k expression), PYTEST_ARGS, TEST_TIMEOUT (per test, s),
# STAGE_TIMEOUT (per stage, s), DISPATCH_ARGS / LL_ARGS (extra benchmark arguments).
# Results land in $OUT/results/ (CSV, Markdown, PNG) and are also packed into $OUT/results.tar.gz;
# each stage's log is $OUT/logs/<stage>.log; $OUT/summary.txt says which stages passed.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$(pwd)/src${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-$(pwd)/gpu-out}"
mkdir -p "$OUT/logs" "$OUT/results"
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(info tests bench-dispatch bench-low-latency bench-p2p bench-allgather demo)
RES="$OUT/results"

run_stage() {
  local name=$1; shift
  local t0=$(date +%s)
  echo "=== $name: $*" | tee -a "$OUT/summary.txt"
  if timeout "${STAGE_TIMEOUT:-900}" "$@" >"$OUT/logs/$name.log" 2>&1; then
    echo "    PASS ($(( $(date +%s) - t0 )) s)" | tee -a "$OUT/summary.txt"
  else
    echo "    FAIL rc=$? ($(( $(date +%s) - t0 )) s); last lines:" | tee -a "$OUT/summary.txt"
    tail -n 25 "$OUT/logs/$name.log" | sed 's/^/      /' | tee -a "$OUT/summary.txt"
  fi
}

for stage in "${STAGES[@]}"; do
  case "$stage" in
    info) run_stage info bash -c 'nvidia-smi; nvidia-smi topo -m; python3 -c "import torch,triton;print(torch.__version__,triton.__version__,torch.cuda.nccl.version())"' ;;
    tests) KARGS=(); [ -n "${TEST_FILTER:-}" ] && KARGS=(-k "$TEST_FILTER")
           run_stage tests python3 -m pytest ${TESTS:-tests} -m gpu -v -p no:cacheprovider --timeout=${TEST_TIMEOUT:-300} -rfEs "${KARGS[@]}" ${PYTEST_ARGS:-} ;;
    bench-dispatch) run_stage bench-dispatch python3 -m epcomm bench dispatch --world-size "$NGPU" --out "$RES" ${DISPATCH_ARGS:-} ;;
    bench-low-latency) run_stage bench-low-latency python3 -m epcomm bench low-latency --world-size "$NGPU" --out "$RES" ${LL_ARGS:-} ;;
    bench-p2p) run_stage bench-p2p python3 -m epcomm bench p2p --world-size "$NGPU" --out "$RES" ;;
    bench-allgather) run_stage bench-allgather python3 -m epcomm bench allgather --world-size "$NGPU" --out "$RES" ;;
    demo) run_stage demo python3 -m epcomm demo --world-size "$NGPU" ;;
    *) echo "unknown stage $stage" | tee -a "$OUT/summary.txt" ;;
  esac
done
tar -czf "$OUT/results.tar.gz" -C "$OUT" results logs 2>/dev/null
cat "$OUT/summary.txt"
